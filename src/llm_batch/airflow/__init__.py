"""The Airflow provider: operators, hooks, triggers, decorators, the cluster policy, pools and lanes,
and the Kubernetes object builders (``specs/``), in the layout of Airflow's cncf.kubernetes provider."""
