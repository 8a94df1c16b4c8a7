"""The tools that call ``generate`` for their users (docs/integrations.md): a smolagents agent, TRL's GRPO
training and a LangChain chain, each run with its one line gives what the same run gives without it, and reuses
prefixes (the store's stats). The runs are benchmarks/integrations.py's scenarios, on the tiny model in float64;
a tool not installed skips its tests (the old-release job installs none)."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import max_logit_diff, stock_twin
from transformers import GenerationConfig

import prefixkv
from prefixkv.base.errors import CapacityError
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


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_grpo_at_its_own_defaults_gives_the_same_completions_and_weights(tmp_path: Path, dropout: float) -> None:
    """GRPOConfig() as it comes: bf16=True (an autocast accelerate enters inside the forward) and
    disable_dropout=False; a model without dropout reuses prompts, one with it runs stock, as TRL alone does."""
    pytest.importorskip("trl")
    shared = "Solve the problem and explain each step. " * 3
    prompts = [shared + "Problem one.", shared + "Problem two."]

    def model() -> torch.nn.Module:
        config = prefixkv.models.tiny_config("llama", vocab_size=320, max_position_embeddings=8192)
        config.attention_dropout = dropout
        return prefixkv.models.build(config, dtype=torch.float32).train()

    def run(enabled: bool) -> scenarios.GRPORun:
        return scenarios.grpo_run(
            model, prompts, enabled=enabled, steps=2, num_generations=4, batch_size=8,
            out_dir=str(tmp_path / str(enabled)), defaults=True,
        )  # fmt: skip

    plain = run(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = run(True)
    assert fast.completions == plain.completions
    assert all(torch.equal(fast.weights[k], plain.weights[k]) for k in plain.weights)
    said = [str(w.message) for w in caught if "is random in training mode" in str(w.message)]
    if dropout:
        assert len(said) == 1 and "attention_dropout=0.1" in said[0], said
        assert all(s.queries == 0 for s in fast.stats)  # stock: no cache was built
    else:
        assert not said
        first, second = fast.stats
        assert first.misses == 1 and first.hit_tokens > first.prompt_tokens / 2
        assert second.hit_tokens == 2 * first.hit_tokens


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


class _Accelerator:
    """What the adapter reads of accelerate's ``Accelerator``: ``autocast()``, bfloat16 (``bf16=True``)."""

    def autocast(self) -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16)


def _rollout_gap(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """GRPO's figure of a rollout under bfloat16 autocast (GRPOConfig's bf16=True): for each sampled token, how far
    the log-probability ``generate`` sampled it with is from the one the trainer recomputes in one forward over
    prompt and completion, as TRL's ``_get_per_token_logps`` does."""
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    torch.manual_seed(seed)
    with torch.no_grad(), bf16:
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=0, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        whole = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1] :])], 1)
        recomputed = model(input_ids=out.sequences, attention_mask=whole).logits[:, ids.shape[1] - 1 : -1].float()
    tokens = out.sequences[:, ids.shape[1] :, None]
    sampled = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, tokens)
    return (sampled - torch.log_softmax(recomputed, -1).gather(-1, tokens)).abs()


def test_trl_rollout_log_probs_under_bf16_autocast_are_as_close_to_the_trainers_as_stock() -> None:
    """Issue 52: under TRL's bfloat16 autocast a split prefill rounds otherwise than one forward (stock's own logits
    move when its prefill is split), so prefixkv's rollout is not TRL's bit for bit, and docs/integrations.md states
    the promise where it holds: the gap RL users watch, between the rollout's log-probabilities and the trainer's
    recomputed ones, is stock's. Measured here on the tiny model (2 prompts x 4 generations, left-padded, a warm
    store: the same prompts before, the same weights) and in docs/integrations.md on SmolLM2."""
    from conftest import left_pad, random_tokens

    model = prefixkv.models.tiny_model("llama", dtype=torch.float32).train()
    system = random_tokens(40, seed=1)
    ids, mask = left_pad([torch.cat([system, random_tokens(n, seed=n)]) for n in (5, 9) for _ in range(4)])
    stock = _rollout_gap(stock_twin(model), ids, mask, seed=0)
    trainer = _fake_trainer(model)
    trainer.accelerator = _Accelerator()
    store = prefixkv_trl.enable(trainer, block_size=4)
    _rollout_gap(model, ids, mask, seed=1)  # the store warm
    fast = _rollout_gap(model, ids, mask, seed=0)
    prefixkv_trl.disable(trainer)
    assert store.stats.hit_tokens >= 6 * 40  # the second call's rows and the first's repeats reuse the prompt
    assert float(fast.mean()) <= 1.5 * float(stock.mean()) + 1e-3, (fast.mean(), stock.mean())
    assert float(fast.max()) <= 1.5 * float(stock.max()) + 1e-2, (fast.max(), stock.max())


def _sampled(model: torch.nn.Module, ids: torch.Tensor, seed: int) -> Any:
    torch.manual_seed(seed)
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=True, top_k=20, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip


RANDOM_IN_TRAINING = {
    "dropout": ("llama", {"attention_dropout": 0.1}, "model.layers.0.self_attn.attention_dropout=0.1"),
    "layerdrop": ("opt", {"layerdrop": 0.5, "dropout": 0.0, "attention_dropout": 0.0}, "model.decoder.layerdrop=0.5"),
    "router_jitter": ("mixtral", {"router_jitter_noise": 0.5}, "model.layers.0.mlp.jitter_noise=0.5"),
}


@pytest.mark.parametrize("case", sorted(RANDOM_IN_TRAINING))
def test_trl_generates_as_trl_does_where_training_mode_is_random(case: str) -> None:
    """TRL generates in training mode: where that is random (dropout, LayerDrop, MoE router jitter), the adapter
    runs TRL's generate as it is, seed for seed, and says once why nothing is reused."""
    family, config, what = RANDOM_IN_TRAINING[case]
    model = prefixkv.models.tiny_model(family, dtype=torch.float64, **config).train()
    assert prefixkv_trl.random_in_training(model) == what
    trainer = _fake_trainer(model)
    store = prefixkv_trl.enable(trainer, block_size=4)
    ids = torch.arange(3, 30)[None].repeat(4, 1)  # a prompt repeated num_generations times, as TRL batches it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [_sampled(model, ids, seed) for seed in (0, 1)]
    refs = [_sampled(stock_twin(model), ids, seed) for seed in (0, 1)]
    for out, ref in zip(outs, refs):
        assert torch.equal(out.sequences, ref.sequences)
        assert max_logit_diff(out.logits, ref.logits) == 0.0
    assert max_logit_diff(outs[0].logits, outs[1].logits) > 1e-3  # random indeed: each seed its own logits
    said = [str(w.message) for w in caught if "is random in training mode" in str(w.message)]
    assert len(said) == 1 and what in said[0], said
    assert model.training and store.stats.queries == 0
    prefixkv_trl.disable(trainer)


@pytest.mark.parametrize(
    ("family", "config", "remedy"),
    [
        ("llama", {"attention_dropout": 0.1}, "leaves it as it is (it zeroes torch.nn.Dropout modules only): load "
         "the model with attention_dropout=0.0"),
        ("mixtral", {"router_jitter_noise": 0.5}, "load the model with router_jitter_noise=0.0"),
        ("gpt2", {}, "build the trainer with disable_dropout=True"),
    ],
)  # fmt: skip
def test_trl_warning_gives_a_remedy_that_works(family: str, config: dict, remedy: str) -> None:
    """TRL's disable_dropout=True zeroes nn.Dropout modules only: the warning says so where the randomness is a
    float attribute (Llama's attention_dropout), and following its remedy gives reuse, with stock's logits."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = prefixkv.models.tiny_model(family, dtype=torch.float64, **config).train()
    trl_utils.disable_dropout_in_model(model)  # what disable_dropout=True does
    trainer = _fake_trainer(model)
    prefixkv_trl.enable(trainer, block_size=4)
    ids = torch.arange(3, 30)[None].repeat(4, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _sampled(model, ids, 0)
    said = [str(w.message) for w in caught if "is random in training mode" in str(w.message)]
    if family == "gpt2":  # its dropout is nn.Dropout modules, which disable_dropout=True zeroed
        assert not said
    else:
        assert len(said) == 1 and remedy in said[0], said
    prefixkv_trl.disable(trainer)
    # the remedy followed: built with the field at 0.0 (GPT-2: dropout modules zeroed, as above)
    fixed = {k: 0.0 for k in config}
    model = prefixkv.models.tiny_model(family, dtype=torch.float64, **fixed).train()
    if family == "gpt2":
        assert prefixkv_trl.random_in_training(model) is not None
        assert remedy in prefixkv_trl._randomness(model).remedy
        trl_utils.disable_dropout_in_model(model)
    assert prefixkv_trl.random_in_training(model) is None
    trainer = _fake_trainer(model)
    store = prefixkv_trl.enable(trainer, block_size=4)
    out, ref = _sampled(model, ids, 0), _sampled(stock_twin(model), ids, 0)
    assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out.logits, ref.logits) <= 1e-6
    assert store.stats.hit_tokens == 3 * 24
    prefixkv_trl.disable(trainer)


def test_trl_restores_every_module_mode_when_generate_raises() -> None:
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64).train()
    model.model.layers[1].eval()
    trainer = _fake_trainer(model)
    store = prefixkv.PrefixStore(model, block_size=4, num_blocks=12)
    prefixkv_trl.enable(trainer, store)
    ids = torch.arange(3, 30)[None].repeat(2, 1)  # 7 blocks, then one more per row every 4 tokens
    modes = [m.training for m in model.modules()]
    with pytest.raises(CapacityError):
        model.generate(ids, attention_mask=torch.ones_like(ids), min_new_tokens=24, max_new_tokens=24, do_sample=False)
    assert [m.training for m in model.modules()] == modes
    # a later ordinary call: stock's logits
    out, ref = _sampled(model, ids[:, :20], 3), _sampled(stock_twin(model), ids[:, :20], 3)
    assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out.logits, ref.logits) <= 1e-6
    assert [m.training for m in model.modules()] == modes
    prefixkv_trl.disable(trainer)
    store.close()


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
