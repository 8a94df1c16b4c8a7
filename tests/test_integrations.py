"""The tools that call ``generate`` for their users (docs/integrations.md): a smolagents agent, TRL's GRPO
training and a LangChain chain, each run with its one line gives what the same run gives without it, and reuses
prefixes (the store's stats). The runs are benchmarks/integrations.py's scenarios, on the tiny model in float64;
a tool not installed skips its tests (the old-release job installs none)."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

import prefixkv
from prefixkv.integrations import trl as prefixkv_trl

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import integrations as scenarios


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    """The tiny model in float64 and the byte tokenizer, saved as smolagents' TransformersModel loads them."""
    scenarios.model_for("tiny", torch.float64).save_pretrained(tmp_path)
    scenarios.byte_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


def test_smolagents_agent_takes_the_same_steps_and_reuses_the_conversation(model_dir: str) -> None:
    pytest.importorskip("smolagents")
    plain = scenarios.agent_run(model_dir, steps=4, enabled=False)
    fast = scenarios.agent_run(model_dir, steps=4, enabled=True)
    assert plain.dtype == fast.dtype == torch.float64
    # each step's output starts with six letters of the model's own choice, which hang on its logits
    assert len(fast.outputs) == 4 and all("<code>" in out for out in fast.outputs)
    assert fast.outputs == plain.outputs
    assert fast.answer == plain.answer and str(fast.answer).startswith("record last:")
    # only the first step computes its whole prompt; every later one reuses the conversation up to it
    assert fast.stats is not None and fast.stats.queries == 4 and fast.stats.misses == 1
    assert fast.stats.hit_tokens > fast.stats.prompt_tokens / 2


def test_grpo_training_gives_the_same_completions_and_weights(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    shared = "Solve the problem and explain each step. " * 3
    prompts = [shared + "Problem one.", shared + "Problem two."]

    def run(enabled: bool) -> scenarios.GRPORun:
        return scenarios.grpo_run(
            lambda: scenarios.model_for("tiny", torch.float64).train(),
            prompts,
            enabled=enabled,
            steps=2,
            num_generations=4,
            batch_size=8,
            out_dir=str(tmp_path / str(enabled)),
        )

    plain, fast = run(False), run(True)
    assert len(fast.completions) == 2 and all(len(step) == 8 for step in fast.completions)
    assert fast.completions == plain.completions  # seeded sampling, the same at both steps
    assert fast.weights.keys() == plain.weights.keys()
    assert all(torch.equal(fast.weights[k], plain.weights[k]) for k in plain.weights)
    assert any(
        not torch.equal(fast.weights[k], v) for k, v in scenarios.model_for("tiny", torch.float64).state_dict().items()
    )
    first, second = fast.stats
    # step 1: one row computes the shared prompt, the 7 others reuse it; step 2 has the same prompts but new
    # weights: again one miss (a hit on step 1's K/V would be stale), and the same reuse within the step
    assert first.misses == 1 and first.hit_tokens > first.prompt_tokens / 2
    assert second.misses == 2 and second.hit_tokens == 2 * first.hit_tokens


def _fake_trainer(model: torch.nn.Module, **args: object) -> types.SimpleNamespace:
    """What prefixkv.integrations.trl.enable reads of a GRPOTrainer: args, generation_config, model."""
    return types.SimpleNamespace(args=types.SimpleNamespace(**args), generation_config=GenerationConfig(), model=model)


def test_trl_generate_runs_in_eval_mode_and_restores_every_module_mode() -> None:
    model = prefixkv.models.tiny_model("llama").train()
    model.model.layers[1].eval()  # a frozen part stays as it was
    trainer = _fake_trainer(model)
    store = prefixkv_trl.enable(trainer, block_size=4)
    seen = []
    model.model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    ids = torch.arange(3, 30)[None].repeat(4, 1)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert seen and not any(seen)
    assert model.training and model.model.layers[0].training and not model.model.layers[1].training
    assert store.stats.misses == 1 and store.stats.hit_tokens == 3 * 24  # 3 rows reuse the 6 whole blocks of row 0
    prefixkv_trl.disable(trainer)
    assert "generate" not in vars(model) and store.closed


def test_trl_with_dropout_in_training_mode_warns_and_reuses_nothing() -> None:
    model = prefixkv.models.tiny_model("llama", attention_dropout=0.1).train()
    assert prefixkv_trl.random_in_training(model) == "model.layers.0.self_attn.attention_dropout=0.1"
    trainer = _fake_trainer(model)
    store = prefixkv_trl.enable(trainer, block_size=4)
    ids = torch.arange(3, 30)[None].repeat(2, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    messages = [str(w.message) for w in caught]
    assert any("attention_dropout=0.1 is random in training mode" in m for m in messages), messages
    assert store.stats.hit_tokens == 0
    prefixkv_trl.disable(trainer)


@pytest.mark.parametrize(
    ("args", "config", "match"),
    [
        ({"use_vllm": True}, {}, "use_vllm=True"),
        ({"use_transformers_continuous_batching": True}, {}, "continuous batching"),
        ({}, {"use_cache": False}, "use_cache=False"),
        ({}, {"cache_implementation": "static"}, "cache_implementation='static'"),
    ],
)
def test_trl_refuses_a_generation_that_bypasses_the_cache(args: dict, config: dict, match: str) -> None:
    model = prefixkv.models.tiny_model("llama")
    trainer = _fake_trainer(model, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GenerationConfig's own remarks on its fields
        trainer.generation_config = GenerationConfig(**config)
    with pytest.raises(ValueError, match=match):
        prefixkv_trl.enable(trainer)
    assert "generate" not in vars(model)


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_chat_chain_gives_the_same_answers_and_reuses_the_history(stream: bool) -> None:
    pytest.importorskip("langchain_huggingface")
    model = scenarios.model_for("tiny", torch.float64)
    document = "the records are kept in order, one per line. " * 4
    plain = scenarios.chain_run(model, turns=3, enabled=False, document=document, stream=stream)
    fast = scenarios.chain_run(model, turns=3, enabled=True, document=document, stream=stream)
    assert all(answer.strip() for answer in plain.answers)
    assert fast.answers == plain.answers
    # turn 1 computes the system prompt; turns 2 and 3 reuse it and the conversation before them
    assert fast.stats is not None and fast.stats.queries == 3 and fast.stats.misses == 1
    assert fast.stats.hit_tokens > fast.stats.prompt_tokens / 2
