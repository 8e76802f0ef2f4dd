"""Real models from the ecosystem, in tiny configurations with random weights (nothing is ever
downloaded), each with a seeded builder and an example input.

``Model.build(seed)`` returns the model in eval mode; ``Model.inputs()`` gives positional args;
``Model.output(out)`` picks the tensor to compare from what ``forward`` returns (Hugging Face
models return ``ModelOutput`` objects, feature extractors dicts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn


@dataclass(frozen=True)
class Model:
    name: str
    library: str  # the import that must succeed, else the tests of this model are skipped
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple[Any, ...]]
    output: Callable[[Any], torch.Tensor] = lambda out: out
    marks: tuple = field(default_factory=tuple)

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.make().eval()


def _logits(out: Any) -> torch.Tensor:
    return out.logits


def _first(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def images() -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)),)


def features() -> tuple[torch.Tensor]:
    return (torch.randn(4, 6, generator=torch.Generator().manual_seed(1)),)


def tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1)),)


# -- torchvision ------------------------------------------------------------------------------------


def resnet() -> nn.Module:
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5)


def mobilenet() -> nn.Module:
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(num_classes=5, width_mult=0.25)


def feature_extractor() -> nn.Module:
    from torchvision.models.feature_extraction import create_feature_extractor

    return create_feature_extractor(resnet().eval(), return_nodes={"layer2": "features"})


# -- timm -------------------------------------------------------------------------------------------


def vit() -> nn.Module:
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
        num_classes=5,
    )


def convnext() -> nn.Module:
    import timm

    return timm.create_model(
        "convnext_atto", pretrained=False, depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), num_classes=5
    )


# -- Hugging Face transformers ----------------------------------------------------------------------


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)


def llama_config(**extra: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_cache=False,
        **extra,
    )


def llama() -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return BertForMaskedLM(config)


def t5(attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return T5ForConditionalGeneration(config)


def t5_eager() -> nn.Module:
    return t5(attn_implementation="eager")


def t5_inputs() -> tuple[torch.Tensor, ...]:
    (ids,) = tokens()
    return ids, None, ids[:, :5]  # input_ids, attention_mask, decoder_input_ids


# -- peft and torch parametrizations ----------------------------------------------------------------


def lora_llama() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        llama(),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    return model


def parametrized() -> nn.Module:
    from torch.nn.utils import parametrizations

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    parametrizations.weight_norm(model[0])
    parametrizations.orthogonal(model[2])
    parametrizations.spectral_norm(model[4])
    return model


MODELS = [
    Model("resnet", "torchvision", resnet, images),
    Model("mobilenet_v3", "torchvision", mobilenet, images),
    Model(
        "feature_extractor", "torchvision", feature_extractor, images, lambda out: out["features"]
    ),
    Model("vit", "timm", vit, images),
    Model("convnext", "timm", convnext, images),
    Model("gpt2", "transformers", gpt2, tokens, _logits),
    Model("llama", "transformers", llama, tokens, _logits),
    Model("bert", "transformers", bert, tokens, _logits),
    Model("t5", "transformers", t5, t5_inputs, _logits),
    Model("t5_eager", "transformers", t5_eager, t5_inputs, _logits),
    Model("lora_llama", "peft", lora_llama, tokens, _logits),
    Model("parametrized", "torch", parametrized, features),
]


def params(
    models: list[Model] = MODELS,
    *,
    leave_out: set[str] = frozenset(),
    skip: dict[str, str] | None = None,
) -> list[Any]:
    """``pytest.param`` for each model but those in ``leave_out``; ``skip`` maps a model to the
    reason it is skipped with (each such skip is on tests/allowed_skips.toml).

    A model's library must import: only a missing library (``ImportError``) skips its tests, with
    the reason; any other failure while importing it is raised, so that a broken install or an
    upstream release that breaks the zoo fails the run instead of hiding as skips."""
    out = []
    for model in models:
        if model.name in leave_out:
            continue
        marks = list(model.marks)
        if skip and model.name in skip:
            marks.append(pytest.mark.skip(reason=skip[model.name]))
        try:
            __import__(model.library)
        except ImportError as error:
            marks.append(pytest.mark.skip(reason=f"{model.library} is not installed: {error}"))
        out.append(pytest.param(model, id=model.name, marks=marks))
    return out
