#!/usr/bin/env bash
# Stage the gRPC wheels Baton needs to import on the GPU machine (Python 3.12, x86-64, no network), and xgrammar.
#
# The device image has grpcio and protobuf of unknown versions and lacks grpcio-health-checking and
# grpcio-reflection. Those two are pure Python, but their generated stubs refuse to import unless
# grpcio and protobuf are at least the versions they were generated with, so this script stages one
# consistent set: grpcio and protobuf at the versions installed here, plus health-checking and
# reflection from the same grpcio major.minor series (newest release <= our grpcio).
#
#   bash deploy/gpu_wheels.sh [GRPCIO_VERSION]     # default: the grpcio installed here
#
# Then, in the device call: carry ".whl" and start the command with
#   bash .whl/install.sh && export PYTHONPATH="$PWD:/tmp/gpu-site:${PYTHONPATH:-}"
# (/tmp/gpu-site is also where ../shared/device/stage.sh installs flash-linear-attention.)
set -euo pipefail
cd "$(dirname "$0")/.."

py=python3
grpc_version=${1:-$($py -c 'import importlib.metadata as m; print(m.version("grpcio"))')}
protobuf_version=$($py -c 'import importlib.metadata as m; print(m.version("protobuf"))')
series=$(echo "$grpc_version" | cut -d. -f1,2)

dest=.whl
mkdir -p "$dest"
# Keep one version of each package: drop what an earlier run staged.
rm -f "$dest"/grpcio-*.whl "$dest"/grpcio_*.whl "$dest"/protobuf-*.whl

$py -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" \
    "grpcio==$grpc_version" \
    "protobuf==$protobuf_version" \
    "grpcio-health-checking>=$series.0,<=$grpc_version" \
    "grpcio-reflection>=$series.0,<=$grpc_version"
# structured outputs (baton/grammar.py): xgrammar, its compiled runtime and pydantic (the device image has none:
# xgrammar's import failed there on 2026-12-07, 'No module named pydantic'), at the versions installed here (the
# rest it needs, torch, transformers, triton, numpy, is the device image's; typing_extensions as pydantic needs it)
rm -f "$dest"/xgrammar-*.whl "$dest"/apache_tvm_ffi-*.whl "$dest"/pydantic*.whl "$dest"/annotated_types-*.whl \
    "$dest"/typing_inspection-*.whl "$dest"/typing_extensions-*.whl
v() { $py -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
$py -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
    "xgrammar==$(v xgrammar)" "apache-tvm-ffi==$(v apache-tvm-ffi)" "pydantic==$(v pydantic)" \
    "pydantic-core==$(v pydantic-core)" "annotated-types==$(v annotated-types)" \
    "typing-inspection==$(v typing-inspection)" "typing-extensions==$(v typing_extensions)"

cat > "$dest/install.sh" <<'EOT'
#!/usr/bin/env bash
# Installs the staged wheels into /tmp/gpu-site (put it first on PYTHONPATH).
set -e
d=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-site "$d"/*.whl
EOT
chmod +x "$dest/install.sh"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || grep -qxF '/.whl/' .gitignore \
    || echo '/.whl/' >> .git/info/exclude
echo "staged in $dest/: $(cd "$dest" && ls *.whl | tr '\n' ' ')"
