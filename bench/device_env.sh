# Sourced by the bench/device_*.sh scripts on the GPU machine: $OUT, the wheels the image lacks (carried
# in .whl: grpcio-health-checking, grpcio-reflection, py-spy) in /tmp/site, and the environment.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d /tmp/site/grpc_health ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/grpcio_health*.whl .whl/grpcio_reflection*.whl
if [ ! -x /tmp/site/bin/py-spy ] && compgen -G ".whl/py_spy*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pyspy .whl/py_spy*.whl
  mkdir -p /tmp/site/bin && cp /tmp/pyspy/bin/py-spy /tmp/site/bin/
fi
# NVLink multicast stays off (the device README).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
