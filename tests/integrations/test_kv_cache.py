"""A transformers key/value cache passed through checkpointed layers.

In ``eval()`` (gradients for attribution, eval-mode fine-tuning) a layer keeps the
``past_key_values`` it is given and appends to it. The replay in backward must see the
cache as the forward started from it, and leave it as the forward left it: each
test compares gradients, the cache after the forward and the cache after backward
with the same model without remat (``torch.equal``). A cache the forward writes in
place (``StaticCache``) cannot be replayed: it is refused naming ``use_cache=False``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="needs the 'transformers' extra")

from helpers import recorded_replays  # noqa: E402

import torch_remat as remat  # noqa: E402
from torch_remat.integrations import RematConfig, apply_remat  # noqa: E402


def tiny(kind: str, attention: str) -> tuple[nn.Module, type]:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(config)
        layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    elif kind == "mistral":  # a sliding window of 4 over 7 positions
        config = transformers.MistralConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64, sliding_window=4,
        )
        model = transformers.MistralForCausalLM(config)
        layer = transformers.models.mistral.modeling_mistral.MistralDecoderLayer
    else:
        config = transformers.GPT2Config(
            vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(config)
        layer = transformers.models.gpt2.modeling_gpt2.GPT2Block
    model.config._attn_implementation = attention
    return model.double().eval(), layer


# transformers 5 names the argument and the output field ``cache``; earlier releases
# ``past_key_values``
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"


def cache_of(output):
    return getattr(output, CACHE)


def cache_tensors(cache) -> list[torch.Tensor]:
    return [t.detach().clone() for layer in cache.layers for t in (layer.keys, layer.values)]


def prompt_then_one_token(model: nn.Module, cache=None):
    """Two calls sharing one cache (a prompt of 6, then 1 token), a loss over both,
    the cache after the forwards, then backward; returns gradients and both caches."""
    g = torch.Generator().manual_seed(5)
    ids, more = torch.randint(1, 50, (2, 6), generator=g), torch.randint(1, 50, (2, 1), generator=g)
    kwargs = {} if cache is None else {CACHE: cache}
    first = model(input_ids=ids, use_cache=True, **kwargs)
    second = model(input_ids=more, use_cache=True, **{CACHE: cache_of(first)})
    loss = first.logits.pow(2).mean() + second.logits.pow(2).mean()
    after_forward = cache_tensors(cache_of(second))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, after_forward, cache_tensors(cache_of(second))


def assert_equal_lists(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("save_linears", [False, True])
def test_a_dynamic_cache_is_replayed_as_the_forward_saw_it_and_left_as_the_forward_left_it(
    kind, attention, save_linears
):
    plain, layer = tiny(kind, attention)
    expected = prompt_then_one_token(plain)
    model, layer = tiny(kind, attention)
    apply_remat(
        model, check_fn=lambda m: isinstance(m, layer),
        remat=RematConfig(save_modules=nn.Linear) if save_linears else None,
    )
    with recorded_replays() as replayed:
        grads, after_forward, after_backward = prompt_then_one_token(model)
    assert len(replayed) == 4  # two layers, two calls: each replayed once
    assert grads.keys() == expected[0].keys()
    for name in grads:
        assert torch.equal(grads[name], expected[0][name]), name
    assert_equal_lists(after_forward, expected[1])
    # each layer's cache holds 7 positions (6 + 1), not one more block per replay
    assert_equal_lists(after_backward, expected[2])
    if kind != "mistral":  # (a sliding window keeps its last positions only)
        assert after_backward[0].shape[-2] == 7


def test_a_checkpoint_called_directly_with_a_cache_keyword_replays_the_cache_at_entry():
    # the same through remat.checkpoint on one layer's forward, a DynamicCache built
    # by the caller
    model, layer = tiny("llama", "eager")
    reference, _ = tiny("llama", "eager")

    def run(m, use_remat):
        cache = transformers.DynamicCache(config=m.config)
        hidden = m.model.embed_tokens(torch.arange(1, 7).reshape(1, 6)).detach().requires_grad_()
        position_ids = torch.arange(6).unsqueeze(0)
        embeddings = m.model.rotary_emb(hidden, position_ids)
        call = m.model.layers[0]
        if use_remat:
            call = remat.checkpoint(region_name="layer0")(call)
        out = call(hidden, position_embeddings=embeddings, use_cache=True, position_ids=position_ids,
                   **{CACHE: cache})
        out = out[0] if isinstance(out, tuple) else out
        out.pow(2).sum().backward()
        return hidden.grad, [t.clone() for t in (cache.layers[0].keys, cache.layers[0].values)]

    with recorded_replays() as replayed:
        grad, cached = run(model, True)
    assert replayed == ["layer0"]
    expected_grad, expected_cache = run(reference, False)
    assert torch.equal(grad, expected_grad)
    assert_equal_lists(cached, expected_cache)
    assert cached[0].shape[-2] == 6


def test_a_static_cache_written_in_place_is_refused_naming_use_cache_false():
    # without remat this runs; under remat the replay would read the cache the forward
    # filled in place (its gradients were silently wrong before this refusal)
    model, layer = tiny("llama", "eager")
    apply_remat(model, check_fn=lambda m: isinstance(m, layer))
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(remat.SavedTensorModifiedError, match=r"use_cache=False") as info:
        prompt_then_one_token(model, cache)
    assert "key/value cache" in str(info.value)
    assert "model.layers.0" in str(info.value)


def test_a_state_space_layers_cache_written_in_place_is_refused_naming_the_layer():
    # Mamba's cache holds each layer's convolution and recurrent state, which the
    # forward updates in place: refused like a StaticCache, naming the cache layer's
    # class, and without advising a DynamicCache (the cache is one already)
    config = transformers.MambaConfig(
        vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
    )
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config).double().eval()
    layer = transformers.models.mamba.modeling_mamba.MambaBlock
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(3))

    def run():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, use_cache=True).logits.sum().backward()

    run()  # without remat: runs
    apply_remat(model, check_fn=lambda m: isinstance(m, layer))
    with pytest.raises(remat.SavedTensorModifiedError, match=r"use_cache=False") as info:
        run()
    message = str(info.value)
    assert "key/value cache (" in message and "state-space" in message
    assert "or a DynamicCache" not in message
