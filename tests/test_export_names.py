"""What an exported drafter's config.json names: the verifier by a portable name (never one machine's
cache folder), and the draft-token count it keeps beside the k stage 5 measures with."""

from __future__ import annotations

from eagle3.config import TargetParams
from eagle3.target import verifier_name


def test_the_exported_verifier_is_a_portable_name():
    """The embedded target resolves to ~/.cache/eagle3/models/smollm2-135m-<digest> on one machine;
    the drafter names the hub model its GGUF was made from (speculators reads the verifier's config
    from that name), target.served_name when set, else target.model as written."""
    assert verifier_name(TargetParams()) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert verifier_name(TargetParams(served_name="my-org/smol")) == "my-org/smol"
    assert verifier_name(TargetParams(model="meta-llama/Llama-3.1-8B-Instruct")) == "meta-llama/Llama-3.1-8B-Instruct"
    assert verifier_name(TargetParams(model="/models/llama")) == "/models/llama"
    assert ".cache" not in verifier_name(TargetParams())


def test_config_speculative_tokens_is_the_ttt_steps_and_the_serve_command_passes_the_measured_k(tmp_path):
    """speculators writes proposal_methods[0].speculative_tokens = train.ttt_steps (2 on the default)
    while stage 5 measures evaluate.num_speculative_tokens (3): every command this project prints
    passes k explicitly, and says why the config's count differs (vLLM reads it only when the drafter
    folder alone is served; stage 4 does not read evaluate.*)."""
    import json

    from eagle3.evaluate.serve import serve_commands
    from eagle3.params_file import load_params
    from eagle3.target import ResolvedTarget

    params = load_params(None, ["tracking.mode=disabled"])
    assert (params.train.ttt_steps, params.evaluate.num_speculative_tokens) == (2, 3)
    run = tmp_path / "run"
    d = run / "04_train" / "drafter"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "speculators_config": {
        "proposal_methods": [{"speculative_tokens": params.train.ttt_steps}]}}))
    target = ResolvedTarget(path=tmp_path / "m", name=str(tmp_path / "m"), source="embedded:smollm2-135m")
    cmd, notes = serve_commands(params, run, target, d)
    assert '"num_speculative_tokens": 3' in cmd
    assert ("k = 3 draft tokens, as measured (evaluate.num_speculative_tokens); the drafter's config.json says "
            "speculative_tokens: 2, the TTT steps it was trained with, which vLLM reads only when the drafter "
            "folder alone is served.") in notes
