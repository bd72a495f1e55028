"""The Airflow provider: operators, hooks, triggers, decorators, cluster policy, lanes and Kubernetes specs."""
