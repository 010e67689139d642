"""Issue 13 failure 1: what this machine's transformers makes of the embedded GGUF (tokenizer specials,
chat template, config/generation_config ids), straight from the GGUF and after eagle3.target's
conversion. usage: probe_tokenizer.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf  (writes $OUT/tok_probe.json)"""
import json
import os
import sys
from pathlib import Path

import transformers
from transformers import AutoTokenizer

from eagle3.params_file import load_params
from eagle3.target import resolve_target

out = Path(os.environ["OUT"])
gguf = Path(sys.argv[1])
rep = {"transformers": transformers.__version__}
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
def specials(t):
    d = {"class": type(t).__name__}
    for k in ("bos", "eos", "pad", "unk"):
        d[f"{k}_token"] = getattr(t, f"{k}_token", None)
        d[f"{k}_token_id"] = getattr(t, f"{k}_token_id", None)
    d["all_special_tokens"] = list(t.all_special_tokens)
    d["added_tokens_decoder_first"] = {int(k): str(v) for k, v in list(t.added_tokens_decoder.items())[:20]}
    d["ids"] = {s: t.convert_tokens_to_ids(s) for s in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    d["padding_side"] = t.padding_side
    d["has_chat_template"] = bool(t.chat_template)
    if t.chat_template:
        d["chat_template"] = t.chat_template
        msgs = [{"role": "user", "content": "Hi"}]
        d["rendered_gen_prompt"] = t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return d
rep["gguf_tokenizer"] = specials(tok)

p = load_params(None, {"target": {"model": "embedded:smollm2-135m"}})
r = resolve_target(p.target)
rep["converted_dir"] = str(r.path)
tok2 = AutoTokenizer.from_pretrained(r.path)
rep["converted_tokenizer"] = specials(tok2)
for f in ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json"):
    fp = r.path / f
    rep[f] = json.loads(fp.read_text()) if fp.exists() else None
try:
    from transformers import GenerationConfig
    rep["GenerationConfig.from_pretrained"] = GenerationConfig.from_pretrained(r.path).to_dict()
except Exception as e:  # noqa: BLE001 - a probe records whatever fails
    rep["GenerationConfig.from_pretrained"] = f"{type(e).__name__}: {e}"
(out / "tok_probe.json").write_text(json.dumps(rep, indent=1, default=str))
t = rep["converted_tokenizer"]
print("TOK", {k: t[k] for k in ("class", "bos_token", "eos_token", "eos_token_id", "pad_token", "pad_token_id", "ids")})
print("GENCFG", rep["generation_config.json"])
keys = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "dtype", "torch_dtype")
print("CFG ids", {k: (rep["config.json"] or {}).get(k) for k in keys})
