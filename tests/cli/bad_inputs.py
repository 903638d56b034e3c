"""The bad inputs of the command-line suite (``test_bad_input.py``): invalid configs and
malformed data rows, each with the words its error message must contain.

A case is the argv after ``posttrain`` plus the fragments the one-line message must name (the
key, the file, the row). ``{tmp}`` in an argument is the test's folder, ``{model}`` a small saved
model folder, ``{file}`` the data file the case wrote. Every run is small (a 1-layer model of
width 32, a few rows, one step), so a case that slipped through validation still ends quickly,
and is then reported as a run that should have been refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TINY = ["model.tiny.layers=1", "model.tiny.hidden=32", "model.tiny.heads=2"]
SMALL_RUN = ["steps=1", "output_dir={tmp}/run", "save_every=0"]
BASE = {
    "sft": ["sft", *TINY, "data.task=reverse", "data.n_train=16", "data.n_eval=9", "eval_size=0", "batch_size=4"],
    "rm": ["rm", *TINY, "data.task=preference", "data.n_train=16", "data.n_eval=0", "batch_size=4"],
    "dpo": ["dpo", *TINY, "data.task=preference", "data.n_train=16", "data.n_eval=0", "batch_size=4"],
    "rl": [
        "rl", *TINY, "data.task=reverse", "data.n_train=16", "data.n_eval=9", "eval_size=0",
        "prompts_per_step=2", "samples_per_prompt=2", "max_new_tokens=4", "reward_workers=0", "preflight=false",
    ],
}  # fmt: skip
OFFLINE = ("sft", "rm", "dpo")


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: list[str]  # fragments the error message names (after {tmp}/{file} are filled in)
    files: dict[str, str] = field(default_factory=dict)  # name → text written under {tmp}


def _run(command: str, *overrides: str) -> list[str]:
    return [*BASE[command], *SMALL_RUN, *overrides]


# ---------------------------------------------------------------------------------- configs
# (override, words the message must hold) valid for every training command
# an entry may hold several overrides separated by " ; "
COMMON_CONFIGS = [
    ("stepz=3", ["stepz", "steps"]),
    ("steps=-1", ["steps"]),
    ("steps=abc", ["steps"]),
    ("steps=1.5", ["steps"]),
    ("learning_rate=-0.1", ["learning_rate"]),
    ("learning_rate=fast", ["learning_rate"]),
    ("model.tiny.hidden=30", ["model.tiny.hidden", "heads"]),
    ("model.tiny.heads=0", ["model.tiny.heads"]),
    ("model.tiny.arch=gpt5", ["model.tiny.arch", "llama"]),
    ("model.tiny.layers=0", ["model.tiny.layers"]),
    ("model.tiny.intermediate=0", ["model.tiny.intermediate"]),
    ("model.dtype=float8", ["model.dtype", "bfloat16"]),
    ("model.path={tmp}/no_such_model", ["model.path", "no_such_model"]),
    ("model.path={tmp}/not_a_model.txt", ["model.path", "not_a_model.txt"]),
    ("model.path={tmp}/empty_folder", ["model.path", "empty_folder"]),
    ("model.lora.r=0", ["model.lora.r"]),
    ("model.lora.dropout=1.5", ["model.lora.dropout"]),
    ("model.lora.target_modules=[no_such_layer]", ["model.lora.target_modules", "no_such_layer"]),
    ("model.colour=blue", ["model.colour"]),
    ("model=3", ["model"]),
    ("model.tiny=3", ["model.tiny"]),
    ("data.path={tmp}/missing.jsonl", ["missing.jsonl", "does not exist"]),
    ("data.path={tmp}/rows.txt", ["rows.txt", ".jsonl"]),
    ("data.task=no_such_task", ["no_such_task", "reverse"]),
    ("data.n_eval=-1", ["data.n_eval"]),
    ("data.n_train=0", ["data.n_train"]),
    ("data.format=weird", ["data.format", "prompt_completion"]),
    ("data.on_bad_row=ignore", ["data.on_bad_row", "skip"]),
    ("data.prompt_template=no_such_template", ["data.prompt_template", "{prompt}"]),
    ("data.task_options=[1]", ["data.task_options"]),
    ("data.eval_path={tmp}/missing_eval.jsonl", ["data.eval_path"]),
    ("data.split=train", ["data.split"]),
    ("seed=1.5", ["seed"]),
    ("seed=-1", ["seed"]),
    ("output_dir={tmp}/a_file.txt", ["output_dir", "a_file.txt"]),
    ("resume={tmp}/no_such_checkpoint", ["no_such_checkpoint", "does not exist"]),
    ("resume={tmp}/empty_folder", ["empty_folder", "COMPLETE is missing"]),
    ("resume=maybe", ["maybe"]),
    ("overwrite=maybe", ["overwrite"]),
    ("save_every=-1", ["save_every"]),
    ("keep_last=0", ["keep_last"]),
    ("eval_every=-2", ["eval_every"]),
    ("log_every=0", ["log_every"]),
    ("lr_scheduler=exponential", ["lr_scheduler", "cosine"]),
    ("warmup_steps=-1", ["warmup_steps"]),
    ("adam_betas=[0.9]", ["adam_betas"]),
    ("adam_betas=[1.5, 0.9]", ["adam_betas"]),
    ("max_grad_norm=-1", ["max_grad_norm"]),
    ("weight_decay=-1", ["weight_decay"]),
    ("threads=0", ["threads"]),
    ("device=tpu", ["device", "cuda:N", "mps"]),
    ("device=cuda:99", ["device = 'cuda:99'", "set device"]),  # no CUDA here, or fewer GPUs
    ("precision=fp16", ["precision", "bf16"]),
    ("precision=bf16 ; model.dtype=bfloat16", ["precision", "model.dtype", "float32"]),
    ("steps", ["steps", "key=value"]),
    ("=3", ["=3", "key=value"]),
    ("rewards=[", ["rewards", "YAML"]),
]
OFFLINE_CONFIGS = [
    ("batch_size=32", ["16 usable rows", "batch_size = 32"]),
    ("batch_size=0", ["batch_size"]),
    ("gradient_accumulation=3", ["batch_size", "gradient_accumulation"]),
    ("gradient_accumulation=0", ["gradient_accumulation"]),
    ("min_lr_ratio=2", ["min_lr_ratio"]),
]
COMMAND_CONFIGS = {
    "sft": [
        ("eval_max_new_tokens=0", ["eval_max_new_tokens"]),
        ("eval_batch_size=0", ["eval_batch_size"]),
        ("eval_size=-1", ["eval_size"]),
        ("data.task=preference", ["preference", "prompt_completion"]),
    ],
    "rm": [
        ("center_coef=-1", ["center_coef"]),
        ("data.task=reverse ; data.n_eval=9", ["prompt_completion", "preference"]),
    ],
    "dpo": [
        ("beta=0", ["beta"]),
        ("loss_type=kto", ["loss_type", "sigmoid"]),
        ("label_smoothing=0.7", ["label_smoothing"]),
        ("loss_type=ipo ; label_smoothing=0.1", ["label_smoothing", "ipo"]),
        ("loss_type=hinge ; label_smoothing=0.1", ["label_smoothing", "hinge"]),
        ("nll_coef=-0.5", ["nll_coef"]),
        ("data.task=reverse ; data.n_eval=9", ["prompt_completion", "preference"]),
    ],
    "rl": [
        ("algorithm=no_such_algorithm", ["no_such_algorithm", "grpo"]),
        ("data.filter.pass_rate=[0.9, 0.1]", ["data.filter.pass_rate", "low must not exceed high"]),
        ("data.filter.pass_rate=[0.1, 2]", ["data.filter.pass_rate"]),
        ("data.filter.k=0 ; data.filter.pass_rate=[0.1, 0.9]", ["data.filter.k"]),
        ("rollout.interrupt=true", ["rollout.interrupt", "max_staleness"]),
        ("algorithm.advantage=no_such", ["algorithm.advantage", "grpo"]),
        ("algorithm.policy_loss=no_such", ["algorithm.policy_loss", "ppo_clip"]),
        ("algorithm.agg_mode=no_such", ["algorithm.agg_mode", "token-mean"]),
        ("algorithm.kl.placement=everywhere", ["algorithm.kl.placement", "reward"]),
        ("algorithm.kl.estimator=k4", ["algorithm.kl.estimator", "k3"]),
        ("algorithm.kl.coef=-1", ["algorithm.kl.coef"]),
        ("algorithm.kl.controller=adaptive", ["algorithm.kl.controller", "reward"]),
        ("algorithm.baseline=median", ["algorithm.baseline", "greedy"]),
        ("algorithm.advantage_options={bogus: 1}", ["bogus"]),
        ("algorithm.loss_options={bogus: 1}", ["bogus"]),
        # values of the wrong type: refused from the entry's type hints, not at the first trained step
        ("algorithm.loss_options={clip_c: abc}", ["algorithm.loss_options.clip_c", "float"]),
        ("algorithm.loss_options={clip_low: [0.2]}", ["algorithm.loss_options.clip_low", "float"]),
        ("algorithm.advantage_options={eps: small}", ["algorithm.advantage_options.eps", "float"]),
        ("algorithm.advantage_options={singleton: bogus}", ["algorithm.advantage_options.singleton", "'zero'"]),
        ("algorithm.advantage=gpg ; algorithm.advantage_options={alpha_mode: all}", ["alpha_mode", "'valid_samples'"]),
        ("algorithm.dynamic_sampling.max_rounds=0", ["algorithm.dynamic_sampling.max_rounds"]),
        ("algorithm.overlong.cache_length=0", ["algorithm.overlong.cache_length"]),
        ("algorithm.entropy_coef=abc", ["algorithm.entropy_coef"]),
        ("algorithm.critic.learning_rate=-1", ["algorithm.critic"]),
        ("algorithm=ppo ; algorithm.critic.loss_coef=2", ["algorithm.critic.loss_coef", "learning_rate"]),
        ("samples_per_prompt=0", ["samples_per_prompt"]),
        ("prompts_per_step=0", ["prompts_per_step"]),
        ("prompts_per_step=32", ["16 usable rows", "prompts_per_step = 32"]),
        ("minibatch_size=3", ["minibatch_size"]),
        ("micro_batch_size=0", ["micro_batch_size"]),
        ("ppo_epochs=0", ["ppo_epochs"]),
        ("monitor_window=3", ["monitor_window 3 can never fire"]),  # hardening 3, item 16
        # hardening 3, item 18: the pre-flight check said "every advantage would be 0", not why
        ("rewards=[reverse] ; reward_weights=[0]", ["every reward weight 0 (reverse)", "monitor"]),
        ("max_new_tokens=100000000", ["leaves no room for a prompt", "context of"]),
        ("model.path=hub:", ["not a path", "org/name"]),
        ("max_new_tokens=0", ["max_new_tokens"]),
        ("sampling.temperature=0", ["sampling.temperature"]),
        ("sampling.top_p=0", ["sampling.top_p"]),
        ("sampling.top_p=2", ["sampling.top_p"]),
        ("sampling.top_k=-1", ["sampling.top_k"]),
        ("sampling.stop=[1, 2]", ["sampling.stop"]),
        ("temperature=-1", ["temperature"]),
        ("rewards=[no_such_reward]", ["no_such_reward", "reverse"]),
        ("rewards=[posttrain_no_such_module:score]", ["posttrain_no_such_module"]),
        ("rewards=[os:no_such_function]", ["os:no_such_function"]),
        ("rewards=[os:sep]", ["os:sep", "callable"]),
        ("rewards=[{weight: 2}]", ["rewards"]),
        ("reward_weights=[1, 2]", ["reward_weights"]),
        ("reward_workers=-1", ["reward_workers"]),
        ("reward_timeout=0", ["reward_timeout"]),
        ("rollout.engine=fastest", ["rollout.engine", "native"]),
        ("engine=fastest", ["engine", "native"]),
        ("rollout.tis_cap=0.5", ["rollout.tis_cap"]),
        ("rollout.compile_step=true ; rollout.engine=transformers", ["rollout.compile_step", "transformers"]),
        ("eval_size=-1", ["eval_size"]),
        ("eval_batch_size=0", ["eval_batch_size"]),
        ("allow_constant_reward=[no_such_reward]", ["allow_constant_reward", "no_such_reward"]),
        ("log_samples=-1", ["log_samples"]),
        ("shared_prompt_forward=maybe", ["shared_prompt_forward"]),
        ("record_rollouts=maybe", ["record_rollouts"]),
        ("rollout.replay={tmp}/missing", ["rollout.replay", "missing", "record_rollouts"]),
        ("rollout.replay={tmp}/broken.yaml", ["rollout.replay", "not a folder"]),
        ("rollout.replay={tmp}", ["rollout.replay", "no recorded step"]),
    ],
}


def config_cases() -> list[Case]:
    cases = []
    for command in BASE:
        pairs = COMMON_CONFIGS + (OFFLINE_CONFIGS if command in OFFLINE else []) + COMMAND_CONFIGS[command]
        for override, expect in pairs:
            cases.append(Case(f"{command}:{override}", _run(command, *override.split(" ; ")), expect))
        cases += [
            Case(f"{command}:--config missing", _run(command, "--config", "{tmp}/missing.yaml"), ["missing.yaml"]),
            Case(f"{command}:--config broken", _run(command, "--config", "{tmp}/broken.yaml"), ["broken.yaml", "YAML"]),
            Case(f"{command}:--config list", _run(command, "--config", "{tmp}/list.yaml"), ["list.yaml", "mapping"]),
            Case(f"{command}:--config bomb", _run(command, "--config", "{tmp}/bomb.yaml"), ["bomb.yaml", "aliases"]),
            Case(f"{command}:--config unknown key", _run(command, "--config", "{tmp}/typo.yaml"), ["stpes", "steps"]),
        ]
    return cases


EVAL_CASES = [
    (["--model", "{tmp}/no_such_model"], ["no_such_model"]),
    (["--model", "{tmp}/not_a_model.txt"], ["not_a_model.txt"]),
    (["--model", "{tmp}/empty_folder"], ["empty_folder"]),
    (["--model", "{model}", "--n", "0"], ["--n"]),
    (["--model", "{model}", "--n", "-3"], ["--n"]),
    (["--model", "{model}", "--k", "-1"], ["--k"]),
    (["--model", "{model}", "--k", "0"], ["--k"]),
    (["--model", "{model}", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--model", "{model}", "--task", "no_such_task"], ["no_such_task", "reverse"]),
    (["--model", "{model}", "--reward", "no_such_reward"], ["no_such_reward"]),
    (["--model", "{model}", "--reward", "os:no_such_function"], ["os:no_such_function"]),
    (["--model", "{model}", "--prompt-template", "no_such_template"], ["no_such_template"]),
]


def eval_cases() -> list[Case]:
    cases = [Case(f"eval:{' '.join(args)}", ["eval", *args], expect) for args, expect in EVAL_CASES]
    cases.append(Case("models:import-gguf missing", ["models", "import-gguf", "{tmp}/x.gguf", "{tmp}/o"], ["x.gguf"]))
    return cases


# "billion laughs": nine aliases of the level below, eight levels deep, under data.task_options
_LAUGHS = ["    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
_LAUGHS += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
CONFIG_FILES = {
    "bomb.yaml": "data:\n  task_options:\n" + "\n".join(_LAUGHS) + "\n",
    "broken.yaml": "steps: [1, 2\nmodel: {",
    "list.yaml": "- steps: 3\n",
    "typo.yaml": "stpes: 3\n",
    "not_a_model.txt": "hello\n",
    "a_file.txt": "hello\n",
    "rows.txt": "hello\n",
}

# ------------------------------------------------------------------------------------- rows
GOOD = {
    "prompt_completion": {"prompt": "Reverse: abc. Answer:", "completion": " cba."},
    "conversational": {
        "messages": [{"role": "user", "content": "Reverse abc"}, {"role": "assistant", "content": "cba"}]
    },
    "preference": {"prompt": "Say hi:", "chosen": " hi", "rejected": " go away"},
    "prompt": {"prompt": "Reverse the name: sean. Answer:"},
}
USER = [{"role": "user", "content": "hello"}]
BOT = [{"role": "bot", "content": "x"}]
BLANK_ASSISTANT = [{"role": "assistant", "content": " "}]
ASSISTANT = [{"role": "assistant", "content": "hi"}]
# (label, a bad row's JSON text, the field the message names); a row's text rather than a dict
# so that rows that are not JSON objects, or not JSON at all, are in the same list
_COMMON_LINES = [
    ("not JSON", '{"prompt": "x", ', None),
    ("a JSON array", '["prompt", "x"]', None),
    ("a JSON string", '"prompt"', None),
    ("a JSON number", "42", None),
    ("JSON null", "null", None),
    ("single quotes", "{'prompt': 'x'}", None),
    ("trailing comma", '{"prompt": "x",}', None),
]
BAD_ROWS = {
    "prompt_completion": [
        ("completion missing", {"prompt": "p"}, "completion"),
        ("completion null", {"prompt": "p", "completion": None}, "completion"),
        ("completion number", {"prompt": "p", "completion": 5}, "completion"),
        ("completion empty", {"prompt": "p", "completion": ""}, "completion"),
        ("completion spaces", {"prompt": "p", "completion": "   "}, "completion"),
        ("completion bool", {"prompt": "p", "completion": True}, "completion"),
        ("completion object", {"prompt": "p", "completion": {"text": "x"}}, "completion"),
        ("completion empty list", {"prompt": USER, "completion": []}, "completion"),
        ("completion user turn", {"prompt": USER, "completion": USER}, "completion"),
        ("completion no content", {"prompt": USER, "completion": [{"role": "assistant"}]}, "completion"),
        ("completion bad role", {"prompt": USER, "completion": [{"role": "bot", "content": "x"}]}, "completion"),
        ("completion number content", {"prompt": USER, "completion": [{**ASSISTANT[0], "content": 3}]}, "completion"),
        ("completion list of strings", {"prompt": USER, "completion": ["hi"]}, "completion"),
        ("completion blank assistant", {"prompt": USER, "completion": BLANK_ASSISTANT}, "completion"),
        ("prompt null", {"prompt": None, "completion": "x"}, "prompt"),
        ("prompt number", {"prompt": 7, "completion": "x"}, "prompt"),
        ("prompt object", {"prompt": {"a": 1}, "completion": "x"}, "prompt"),
        ("prompt empty list", {"prompt": [], "completion": ASSISTANT}, "prompt"),
        ("prompt list of numbers", {"prompt": [1, 2], "completion": ASSISTANT}, "prompt"),
        ("mixed text and messages", {"prompt": USER, "completion": "x"}, "completion"),
        ("mixed messages and text", {"prompt": "p", "completion": ASSISTANT}, "completion"),
    ],
    "conversational": [
        ("messages text", {"messages": "hello"}, "messages"),
        ("messages empty", {"messages": []}, "messages"),
        ("messages null", {"messages": None}, "messages"),
        ("messages number", {"messages": 3}, "messages"),
        ("messages no assistant", {"messages": USER}, "messages"),
        ("messages unknown role", {"messages": [{"role": "human", "content": "x"}, *ASSISTANT]}, "messages"),
        ("messages no role", {"messages": [{"content": "x"}, *ASSISTANT]}, "messages"),
        ("messages no content", {"messages": [{"role": "user"}, *ASSISTANT]}, "messages"),
        ("messages null content", {"messages": [{"role": "user", "content": None}, *ASSISTANT]}, "messages"),
        ("messages list content", {"messages": [{"role": "user", "content": ["x"]}, *ASSISTANT]}, "messages"),
        ("messages string item", {"messages": ["hello", *ASSISTANT]}, "messages"),
        ("messages empty answer", {"messages": [*USER, {"role": "assistant", "content": ""}]}, "messages"),
        ("messages nested list", {"messages": [[*USER], *ASSISTANT]}, "messages"),
    ],
    "preference": [
        ("chosen missing", {"prompt": "p", "rejected": "r"}, None),
        ("rejected missing", {"prompt": "p", "chosen": "c"}, None),
        ("chosen null", {"prompt": "p", "chosen": None, "rejected": "r"}, "chosen"),
        ("rejected null", {"prompt": "p", "chosen": "c", "rejected": None}, "rejected"),
        ("chosen empty", {"prompt": "p", "chosen": "", "rejected": "r"}, "chosen"),
        ("rejected spaces", {"prompt": "p", "chosen": "c", "rejected": "  "}, "rejected"),
        ("chosen number", {"prompt": "p", "chosen": 1, "rejected": "r"}, "chosen"),
        ("rejected object", {"prompt": "p", "chosen": "c", "rejected": {"a": 1}}, "rejected"),
        ("identical pair", {"prompt": "p", "chosen": "same", "rejected": "same"}, "rejected"),
        ("margin text", {"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}, "margin"),
        ("margin bool", {"prompt": "p", "chosen": "c", "rejected": "r", "margin": True}, "margin"),
        ("margin list", {"prompt": "p", "chosen": "c", "rejected": "r", "margin": [1]}, "margin"),
        ("prompt number", {"prompt": 3, "chosen": "c", "rejected": "r"}, "prompt"),
        ("chosen empty list", {"prompt": USER, "chosen": [], "rejected": ASSISTANT}, "chosen"),
        ("chosen user turn", {"prompt": USER, "chosen": USER, "rejected": ASSISTANT}, "chosen"),
        ("rejected bad role", {"prompt": USER, "chosen": ASSISTANT, "rejected": BOT}, "rejected"),
        ("mixed forms", {"prompt": USER, "chosen": "c", "rejected": ASSISTANT}, "chosen"),
        ("identical messages", {"prompt": USER, "chosen": ASSISTANT, "rejected": ASSISTANT}, "rejected"),
    ],
    "prompt": [
        ("prompt empty", {"prompt": ""}, "prompt"),
        ("prompt spaces", {"prompt": "   "}, "prompt"),
        ("prompt null", {"prompt": None}, "prompt"),
        ("prompt number", {"prompt": 12}, "prompt"),
        ("prompt bool", {"prompt": False}, "prompt"),
        ("prompt object", {"prompt": {"text": "x"}}, "prompt"),
        ("prompt empty list", {"prompt": []}, "prompt"),
        ("prompt list of strings", {"prompt": ["a", "b"]}, "prompt"),
        ("prompt bad role", {"prompt": [{"role": "robot", "content": "x"}]}, "prompt"),
        ("prompt no content", {"prompt": [{"role": "user"}]}, "prompt"),
        ("prompt empty message", {"prompt": [{"role": "user", "content": ""}]}, "prompt"),
        ("prompt missing", {"question": "x"}, "prompt"),
        # a reward function receives the batch's own under these names: the column would vanish
        ("column completions", {"prompt": "p", "completions": "reference"}, "completions"),
        ("column prompts", {"prompt": "p", "prompts": "x"}, "prompts"),
        ("column completion_ids", {"prompt": "p", "completion_ids": [1, 2]}, "completion_ids"),
    ],
}  # fmt: skip
# which commands read which format
READERS = {"prompt_completion": ["sft"], "conversational": ["sft"], "preference": ["rm", "dpo"], "prompt": ["rl"]}
POSITIONS = (0, 3)  # the bad row first, or after three good rows


def row_cases() -> list[Case]:
    cases = []
    for data_format, bad_rows in BAD_ROWS.items():
        lines = [(label, json.dumps(row), column) for label, row, column in bad_rows] + _COMMON_LINES
        for label, text, column in lines:
            for command in READERS[data_format]:
                for position in POSITIONS:
                    good = [json.dumps(GOOD[data_format])] * 5
                    rows = [*good[:position], text, *good[position:]]
                    name = f"{command}_{data_format}_{len(cases)}.jsonl"
                    line = position + 1
                    expect = ["{file}", f"line {line}"] + ([repr(column)] if column else [])
                    argv = _run(command, "data.path={file}", "data.task=null")
                    cases.append(
                        Case(
                            f"{command}:{data_format}:{label}@{position}", argv, expect, {name: "\n".join(rows) + "\n"}
                        )
                    )
    return cases
