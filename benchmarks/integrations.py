"""The tools that call ``generate`` for their users, with and without prefixkv (docs/integrations.md): time per
step of a smolagents agent over a 10-step conversation, TRL GRPO's generation time per step with
``num_generations=8``, and a LangChain chat chain's time per turn.

``python benchmarks/integrations.py`` (the small model: 4 layers, hidden 256; a few minutes on 2 cores) or
``--quick`` (the tiny model, seconds). The runs with and without prefixkv alternate, so that machine load hits
both alike; each figure is the median over ``--repeat`` runs. The scenarios are also what
tests/test_integrations.py runs (on the tiny model, in float64), so the benchmark measures the tested paths.

The embedded models have random weights, so what an agent or a GRPO policy generates is noise: the agent's
replies are scripted (:class:`ScriptedReplies`: a few tokens of the model's own, then a tool call forced), and
every text goes through :func:`byte_tokenizer` (one token per byte, so that code and JSON can be spelled).
"""

from __future__ import annotations

import argparse
import importlib.resources
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))

from _common import machine, table

import prefixkv

BYTE_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")
_BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer() -> Any:
    """A byte-level tokenizer built in memory (no download): ids 0-2 are the embedded models' pad, BOS and EOS,
    then chat roles, then the 256 bytes; any text is one token per byte. Left padding and a chat template.

    >>> tok = byte_tokenizer()
    >>> tok.decode(tok('print(lookup("x"))').input_ids)
    'print(lookup("x"))'
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as token_models

    vocab = [*BYTE_SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    tokenizer = Tokenizer(token_models.BPE({t: i for i, t in enumerate(vocab)}, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=_BYTE_CHAT_TEMPLATE,
        padding_side="left",
    )


def model_for(size: str, dtype: torch.dtype = torch.float32) -> Any:
    """``tiny``: 2 layers, hidden 64; ``small``: the demo's 4 layers, hidden 256; both with room for long
    conversations (8192 positions) and the byte tokenizer's 263 ids."""
    config = prefixkv.models.tiny_config("llama", vocab_size=320, max_position_embeddings=8192)
    if size == "small":
        shape = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8}
        config = prefixkv.models.tiny_config("llama", vocab_size=320, max_position_embeddings=8192, **shape)
    elif size != "tiny":
        raise ValueError(f"unknown size {size!r}: tiny or small")
    return prefixkv.models.build(config, dtype=dtype)


class ScriptedReplies(transformers.LogitsProcessor):
    """The agent's replies: in each ``generate`` call, ``free`` tokens of the model's own choice (greedy among
    lowercase letters, so what it writes depends on its logits), then ``replies[call]`` forced token by token,
    then EOS. A call is told from the next by the sequence length (each decode step adds one column)."""

    def __init__(self, tokenizer: Any, replies: list[str], free: int) -> None:
        self.replies = [tokenizer(r, add_special_tokens=False).input_ids for r in replies]
        self.letters = tokenizer("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False).input_ids
        self.eos = tokenizer.eos_token_id
        self.free = free
        self.calls = -1
        self.start = self.last = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        if self.calls < 0 or n != self.last + 1:
            self.calls, self.start = self.calls + 1, n
        self.last = n
        k = n - self.start - self.free
        reply = self.replies[min(self.calls, len(self.replies) - 1)]
        allowed = self.letters if k < 0 else [reply[k] if k < len(reply) else self.eos]
        forced = torch.full_like(scores, float("-inf"))
        forced[:, allowed] = scores[:, allowed]
        return forced


AGENT_SYSTEM_PROMPT = (
    "You are an expert assistant who solves any task using code blobs. Each step, write a short thought, then "
    "python code between <code> and </code>; print what you need to see and the observation comes back. "
    "Call final_answer(...) with the answer once you have it. Tools, called as python functions:"
    "{%- for tool in tools.values() %}\n- {{ tool.name }}: {{ tool.description }}{%- endfor %}\n"
)


@dataclass
class AgentRun:
    """One agent run: its final answer, each step's model output and seconds, the store's stats (``None``
    without prefixkv) and the dtype the model was loaded in."""

    answer: Any
    outputs: list[str]
    step_s: list[float]
    stats: prefixkv.StoreStats | None
    dtype: torch.dtype


def agent_run(model_dir: str, *, steps: int, enabled: bool, manual: str = "", free: int = 6) -> AgentRun:
    """A smolagents ``CodeAgent`` on the model saved at ``model_dir`` (with :func:`byte_tokenizer`) that calls the
    ``lookup`` tool ``steps - 1`` times and answers at step ``steps``; ``manual`` lengthens the system prompt
    (a tool manual), and the tool's observations are 200 characters. ``enabled``: with
    ``prefixkv.enable(model.model)``, the one line of docs/integrations.md."""
    from smolagents import CodeAgent, TransformersModel, tool

    @tool
    def lookup(key: str) -> str:
        """Looks a key up in the records.

        Args:
            key: the key to look up
        """
        return f"record {key}: " + ("the value is " + key + ". ") * 10

    tok = byte_tokenizer()
    replies = [f'Thought: look up {i}.\n<code>\nprint(lookup("{i}"))\n</code>' for i in range(steps - 1)]
    replies.append('Thought: done.\n<code>\nfinal_answer(lookup("last"))\n</code>')
    scripted = transformers.LogitsProcessorList([ScriptedReplies(tok, replies, free)])
    model = TransformersModel(model_id=model_dir, max_new_tokens=200, do_sample=False, logits_processor=scripted)
    store = prefixkv.enable(model.model) if enabled else None
    templates = importlib.resources.files("smolagents.prompts").joinpath("code_agent.yaml").read_text()
    import yaml

    prompt_templates = yaml.safe_load(templates)
    prompt_templates["system_prompt"] = AGENT_SYSTEM_PROMPT + manual
    agent = CodeAgent(
        tools=[lookup], model=model, prompt_templates=prompt_templates, max_steps=steps, verbosity_level=0
    )
    answer = agent.run("Look up the records one by one, then answer.")
    actions = [s for s in agent.memory.steps if hasattr(s, "model_output")]
    stats = None if store is None else store.stats
    if store is not None:
        prefixkv.disable(model.model)
    return AgentRun(
        answer, [s.model_output for s in actions], [s.timing.duration for s in actions], stats, model.model.dtype
    )


@dataclass
class GRPORun:
    """One GRPO training run: every completion the reward function saw, step by step; the seconds of each
    generate call; the store's stats after each step (``None`` without prefixkv); the trained weights."""

    completions: list[list[str]]
    generate_s: list[float]
    stats: list[prefixkv.StoreStats]
    weights: dict[str, torch.Tensor]


def grpo_run(
    make_model: Callable[[], Any],
    prompts: list[str],
    *,
    enabled: bool,
    steps: int = 2,
    num_generations: int = 4,
    batch_size: int = 8,
    completion_length: int = 8,
    out_dir: str,
    defaults: bool = False,
) -> GRPORun:
    """``steps`` steps of TRL's ``GRPOTrainer`` (no vLLM, CPU, seeded sampling) on ``prompts`` with a rule reward
    (the number of letters "a"), the model from ``make_model``. ``enabled``: with
    ``prefixkv.integrations.trl.enable(trainer)``. ``defaults``: GRPOConfig's own mixed precision and dropout
    (``bf16=True``, an autocast; ``disable_dropout=False``), else ``bf16=False``."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from prefixkv.integrations import trl as prefixkv_trl

    run = GRPORun([], [], [], {})
    store: prefixkv.PrefixStore | None = None

    def reward(completions: list[str], **_: Any) -> list[float]:
        run.completions.append(list(completions))
        if store is not None:
            run.stats.append(store.stats)
        return [float(c.count("a")) for c in completions]

    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=batch_size,
        num_generations=num_generations,
        max_completion_length=completion_length,
        max_steps=steps,
        learning_rate=1e-2,
        use_cpu=True,
        **({} if defaults else {"bf16": False}),
        seed=0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    model = make_model()
    dataset = datasets.Dataset.from_dict({"prompt": prompts})
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=byte_tokenizer()
    )
    if enabled:
        store = prefixkv_trl.enable(trainer)
    generate, patched = model.generate, model.__dict__.get("generate")

    def timed(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            run.generate_s.append(time.perf_counter() - start)

    model.generate = timed
    trainer.train()
    if patched is None:
        del model.generate
    else:
        model.generate = patched
    if enabled:
        prefixkv_trl.disable(trainer)
    run.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


@dataclass
class ChainRun:
    """A multi-turn chat through a LangChain chain: each turn's answer and seconds, the store's stats."""

    answers: list[str]
    turn_s: list[float]
    stats: prefixkv.StoreStats | None


def chain_run(
    model: Any, *, turns: int, enabled: bool, document: str, new_tokens: int = 16, stream: bool = False
) -> ChainRun:
    """``ChatPromptTemplate | ChatHuggingFace(HuggingFacePipeline) | StrOutputParser``: a system message holding
    ``document``, the conversation so far, the next question; greedy, ``new_tokens`` per answer; ``stream``: each
    answer streamed (``chain.stream``, LangChain's TextIteratorStreamer path) and joined. ``enabled``: with
    ``prefixkv.enable(pipe.model)``."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline

    tok = byte_tokenizer()
    pipe = transformers.pipeline(
        "text-generation",
        model=model,
        tokenizer=tok,
        max_new_tokens=new_tokens,
        do_sample=False,
        return_full_text=False,
    )
    store = prefixkv.enable(pipe.model) if enabled else None
    chat = ChatHuggingFace(llm=HuggingFacePipeline(pipeline=pipe), tokenizer=tok)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from this document.\n{document}"), MessagesPlaceholder("history"), ("human", "{question}")]
    )
    chain = prompt | chat | StrOutputParser()
    history: list[Any] = []
    run = ChainRun([], [], None)
    for turn in range(turns):
        question = f"question {turn}: what does part {turn} say?"
        start = time.perf_counter()
        inputs = {"document": document, "history": history, "question": question}
        answer = "".join(chain.stream(inputs)) if stream else chain.invoke(inputs)
        run.turn_s.append(time.perf_counter() - start)
        run.answers.append(answer)
        history += [HumanMessage(question), AIMessage(answer)]
    if store is not None:
        run.stats = store.stats
        prefixkv.disable(pipe.model)
    return run


def _alternating(runs: int, fn: Callable[[bool], Any]) -> tuple[list[Any], list[Any]]:
    """``fn(False)`` and ``fn(True)`` ``runs`` times each, alternating (machine load hits both alike)."""
    plain, enabled = [], []
    for _ in range(runs):
        plain.append(fn(False))
        enabled.append(fn(True))
    return plain, enabled


def _median_per_index(series: list[list[float]]) -> list[float]:
    return [statistics.median(values) for values in zip(*series)]


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the tiny model, short runs (a smoke run)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each variant, alternating")
    args = ap.parse_args(argv)
    size = "tiny" if args.quick else "small"
    torch.manual_seed(0)
    lines = [f"Machine: {machine()}; model: {size}; medians of {args.repeat} alternating runs.", ""]

    manual = "Manual of the records: " + "each record holds a key and its value, looked up one at a time. " * 25
    with tempfile.TemporaryDirectory() as folder:
        model_for(size).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
        plain, fast = _alternating(args.repeat, lambda on: agent_run(folder, steps=10, enabled=on, manual=manual))
    same = all(p.outputs == f.outputs and p.answer == f.answer for p, f in zip(plain, fast))
    plain_s, fast_s = _median_per_index([r.step_s for r in plain]), _median_per_index([r.step_s for r in fast])
    stats = fast[-1].stats
    lines += [
        "smolagents CodeAgent, 10 steps (9 tool calls, then final_answer): seconds per step",
        "",
        table(
            ["step", "stock", "prefixkv.enable", "speedup"],
            [[i + 1, f"{p:.3f}", f"{f:.3f}", f"{p / f:.2f}x"] for i, (p, f) in enumerate(zip(plain_s, fast_s))],
        ),
        "",
        f"same outputs and answer: {same}; prompt tokens reused: {stats.hit_tokens} of {stats.prompt_tokens}",
        "",
    ]

    prompt = "Solve the problem and explain each step. " * 25
    prompts = [prompt + f"Problem {i}: add {i} and {i + 1}." for i in range(4)]
    length = 4 if args.quick else 16
    plain_g, fast_g = _alternating(
        args.repeat,
        lambda on: grpo_run(
            lambda: model_for(size).train(),
            prompts,
            enabled=on,
            steps=3,
            num_generations=8,
            batch_size=8,
            completion_length=length,
            out_dir=tempfile.mkdtemp(),
        ),
    )
    same = all(p.completions == f.completions for p, f in zip(plain_g, fast_g))
    # the first step's generate call warms kernels for both; steps 2 and 3 are the measured ones
    plain_s = [statistics.median(r.generate_s[1:]) for r in plain_g]
    fast_s = [statistics.median(r.generate_s[1:]) for r in fast_g]
    p, f = statistics.median(plain_s), statistics.median(fast_s)
    lines += [
        f"TRL GRPOTrainer, num_generations=8, prompts of {len(prompts[0])} tokens, {length}-token completions: "
        "seconds of generation per step",
        "",
        table(["stock", "prefixkv.integrations.trl.enable", "speedup"], [[f"{p:.3f}", f"{f:.3f}", f"{p / f:.2f}x"]]),
        "",
        f"same completions at every step: {same}",
        "",
    ]

    document = "Part of the document: " + "the records are kept in order, one per line, with their keys. " * 30
    chain_model = model_for(size)
    plain_c, fast_c = _alternating(
        args.repeat, lambda on: chain_run(chain_model, turns=6, enabled=on, document=document)
    )
    same = all(p.answers == f.answers for p, f in zip(plain_c, fast_c))
    plain_s, fast_s = _median_per_index([r.turn_s for r in plain_c]), _median_per_index([r.turn_s for r in fast_c])
    stats = fast_c[-1].stats
    lines += [
        f"LangChain prompt | ChatHuggingFace | StrOutputParser, a {len(document)}-character document, 6 turns: "
        "seconds per turn",
        "",
        table(
            ["turn", "stock", "prefixkv.enable", "speedup"],
            [[i + 1, f"{p:.3f}", f"{f:.3f}", f"{p / f:.2f}x"] for i, (p, f) in enumerate(zip(plain_s, fast_s))],
        ),
        "",
        f"same answers: {same}; prompt tokens reused: {stats.hit_tokens} of {stats.prompt_tokens}",
    ]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
