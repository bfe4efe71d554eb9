#!/usr/bin/env bash
# Run HERE (a machine with the package index), before a device run: downloads into .whl/ the
# x86-64 CPython 3.12 wheels of relayout's dependencies that the device image lacks (it has
# torch, numpy, safetensors, xxhash, tokenizers, typer, rich, httpx, pyyaml, prometheus-client,
# pytest, hypothesis, transformers, nvidia-ml-py; it cannot reach a package index).
# The device run then names `.whl` in `carry`; run_gpu_checks.sh installs them offline.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
ex=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$ex")" .whl
grep -qx '/.whl/' "$ex" 2>/dev/null || echo '/.whl/' >>"$ex"
PY=${PYTHON:-python3}
# versions as in the dev venv (one version of each: two stop the offline install)
PKGS=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 typing_extensions==4.16.0 annotated-doc==0.0.7 uvicorn==0.54.0
      zstandard==0.25.0 boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0
      pydantic-settings==2.16.3 python-dotenv==1.2.4 httptools==0.9.0 h11==0.16.0
      opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
      opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2
      opentelemetry-semantic-conventions==0.66b2 protobuf==7.36.2 googleapis-common-protos==1.76.0
      requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 idna==3.21 certifi==2026.10.19.post1
      jinja2==3.1.6 markupsafe==3.0.4)
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
for pkg in "${PKGS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "$pkg"
done
du -sh .whl
ls .whl
