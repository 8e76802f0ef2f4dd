"""A Llama with dynamic RoPE assigns a plain attribute in forward (``max_seq_len_cached``): what
a stateless call restores and what it documents it does not (see ``modstate.call``)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch

import modstate as ms

transformers = pytest.importorskip("transformers")

from models import llama_config  # noqa: E402

LONG = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(2))
MIDDLE = LONG[:, :20]


def dynamic_llama():
    torch.manual_seed(0)
    config = llama_config(
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    config.max_position_embeddings = 16
    return transformers.LlamaForCausalLM(config).eval()


def test_the_rope_buffers_are_restored_but_max_seq_len_cached_is_not_as_in_torch_func():
    model, fresh, twin = dynamic_llama(), dynamic_llama(), dynamic_llama()
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq
    ms.call(model, ms.extract(model, detach=True), LONG)
    assert rotary.inv_freq is inv_freq  # the buffer forward reassigned: restored
    assert int(rotary.max_seq_len_cached) == 24  # the plain attribute: kept, as documented
    # torch.func.functional_call leaves the same attribute behind.
    tied = {"lm_head.weight"}
    state = {k: v for k, v in twin.state_dict().items() if k not in tied}
    torch.func.functional_call(twin, state, (LONG,))
    assert int(twin.model.rotary_emb.max_seq_len_cached) == 24
    # Hence the next ordinary call at a middle length differs from a fresh model's.
    assert not torch.equal(model(MIDDLE).logits, fresh(MIDDLE).logits)


def test_calling_a_copy_keeps_the_model_equal_to_a_fresh_one():
    model, fresh = dynamic_llama(), dynamic_llama()
    ms.call(copy.deepcopy(model), ms.extract(model, detach=True), LONG)
    assert torch.equal(model(MIDDLE).logits, fresh(MIDDLE).logits)


def test_under_threads_max_seq_len_cached_is_one_attribute_for_every_call():
    """Issue 19 part 4. A call at a long length in thread A raises ``max_seq_len_cached`` for the
    calls of every thread; thread B's call at a middle length, with its own tree, then computes
    with the base frequencies, unlike a fresh model. The slots (``inv_freq`` included) stay per
    call: B's tree is untouched by A's. One copy of the model per thread computes like a fresh
    model."""
    model, fresh, template = dynamic_llama(), dynamic_llama(), dynamic_llama()
    expected = fresh(MIDDLE).logits
    trees = {name: ms.extract(model, detach=True) for name in ("a", "b")}
    inv_freq = trees["b"]["model"]["rotary_emb"]["inv_freq"]

    def run(calls: dict[str, Callable[[], torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Run A's call, then B's, each in a thread of its own."""
        out: dict[str, torch.Tensor] = {}
        a_done = threading.Event()

        def a() -> None:
            out["a"] = calls["a"]()
            a_done.set()

        def b() -> None:
            a_done.wait()
            out["b"] = calls["b"]()

        threads = [threading.Thread(target=f) for f in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return out

    with torch.no_grad():
        shared = run(
            {
                "a": lambda: ms.call(model, trees["a"], LONG).logits,
                "b": lambda: ms.call(model, trees["b"], MIDDLE).logits,
            }
        )
        assert int(model.model.rotary_emb.max_seq_len_cached) == 24
        assert not torch.equal(shared["b"], expected)
        assert trees["b"]["model"]["rotary_emb"]["inv_freq"] is inv_freq

        copies = {name: copy.deepcopy(template) for name in ("a", "b")}
        own = run(
            {
                "a": lambda: ms.call(copies["a"], trees["a"], LONG).logits,
                "b": lambda: ms.call(copies["b"], trees["b"], MIDDLE).logits,
            }
        )
        assert torch.equal(own["b"], expected)
