"""Fast token-by-token decoding for a prompt enhancer whose weights are all on one CUDA device.

transformers' eager decode spends ~26 ms per token of a 3.4B model on the H200, almost all of it launching about
1,400 small kernels from Python; reading the weights once takes ~1.6 ms. This decoder keeps the KV cache in fixed
buffers (one slot per position, later slots masked out) so every token runs the same kernels on the same
addresses, and replays them as one CUDA graph per token.

The maths is Ministral3's (transformers' modeling_ministral3): RMSNorm, q/k/v, YaRN rotary tables from the
model's own `rotary_emb`, the Llama-4 query scaling by position, grouped-query SDPA, SiLU MLP, tied head. The
model's own submodules do the projections and MLP, so quantised Linears work unchanged.

`fused` (the default) issues fewer, larger kernels for the same maths, each within float rounding of
transformers' (the tests' bounds): the RMSNorms as one `F.rms_norm` kernel and the weight product (transformers:
seven elementwise kernels), and a decode step's attention as the query heads of each key/value head stacked as
rows of one plain SDPA call (grouped-query SDPA with a mask falls back to the math kernels, which first copy every
cached key and value once per query head group). The CPU and
streamed prompt enhancers keep transformers' path (the reference the tests compare with).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

CACHE_ROUNDING = 256  # slot counts are rounded up to this: a regular key length for the attention kernels


def static_decoding_device(model: nn.Module) -> Optional[torch.device]:
    """The CUDA device this decoder can run `model` on, or None: `computes_like_transformers(model)`, and every
    parameter and buffer sits on that one device."""
    if not computes_like_transformers(model):
        return None
    devices = {t.device for t in list(model.parameters()) + list(model.buffers())}
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    return device if device.type == "cuda" else None


def computes_like_transformers(model: nn.Module) -> bool:
    """Whether this decoder's maths is `model`'s forward. Not when a module carries forward hooks: a streamed
    PE's layers point at device ring slots that only its layer hooks fill, and this decoder calls the layers'
    parts directly, so hooks would silently not run. Not with a sliding attention window, which transformers
    applies and this decoder does not (Baidu's PE config has none)."""
    if getattr(model.config, "sliding_window", None) is not None:
        return False
    return not any(module._forward_pre_hooks or module._forward_hooks for module in model.modules())


class StaticCacheDecoder:
    """Prefill once, then `next_logits(token)` per token; the KV cache holds `capacity` positions."""

    def __init__(self, model: nn.Module, capacity: int, use_graph: bool, fused: bool = True) -> None:
        config = model.config
        self.model = model
        self.fused = fused
        self.layers = model.model.layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        embedding = model.get_input_embeddings().weight
        self.device, self.dtype = embedding.device, embedding.dtype
        self.capacity = -(-capacity // CACHE_ROUNDING) * CACHE_ROUNDING
        shape = (len(self.layers), 1, self.kv_heads, self.capacity, self.head_dim)
        self.keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.values = torch.zeros(shape, device=self.device, dtype=self.dtype)
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.to(device=self.device, dtype=torch.float32)
        self.rope_scaling = float(rotary.attention_scaling)
        rope = config.rope_parameters or {}
        self.query_beta = rope.get("llama_4_scaling_beta")
        self.query_beta_span = rope.get("original_max_position_embeddings")
        self.slots = torch.arange(self.capacity, device=self.device)
        self.token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.position = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.length = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.graph_logits: Optional[torch.Tensor] = None
        if use_graph:
            self._capture()

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [1, vocab] (fp32) after the prompt; the prompt's keys and values fill slots 0..len-1."""
        if len(prompt_ids) >= self.capacity:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit a cache of {self.capacity}")
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(len(prompt_ids), device=self.device)
        self.length = len(prompt_ids)
        return self._forward(ids, positions, mask=None)

    def next_logits(self, token: int) -> torch.Tensor:
        """Logits [1, vocab] (fp32) after appending `token` at the next position."""
        if self.length >= self.capacity:
            raise ValueError(f"the KV cache of {self.capacity} positions is full")
        self.token.fill_(token)
        self.position.fill_(self.length)
        self.length += 1
        if self.graph is not None:
            self.graph.replay()
            return self.graph_logits
        return self._decode_step()

    def next_logits_device(self, token: torch.Tensor) -> torch.Tensor:
        """`next_logits` for a token id held in a device tensor: copied into the graph's input, no host sync."""
        if self.length >= self.capacity:
            raise ValueError(f"the KV cache of {self.capacity} positions is full")
        self.token.copy_(token.reshape(1, 1))
        self.position.fill_(self.length)
        self.length += 1
        if self.graph is not None:
            self.graph.replay()
            return self.graph_logits
        return self._decode_step()

    def close(self) -> None:
        """Drop the graph and the cache now (not when a traceback that holds this decoder lets go).

        The graph's output goes first, while the graph that allocated it still exists."""
        self.graph_logits = None
        self.graph = None
        self.keys = self.values = None

    def _decode_step(self) -> torch.Tensor:
        mask = (self.slots <= self.position)[None, None, None, :]  # slots past this token hold stale keys
        return self._forward(self.token, self.position, mask)

    def _capture(self) -> None:
        # Warm-up and capture write stale keys at slot 0; prefill overwrites them before anything reads them.
        side = _capture_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._decode_step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread is barred from unsafe CUDA calls while it captures, not the host app's others
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            logits = self._decode_step()
        # Under the cudaMallocAsync allocator (current ComfyUI's default) `logits` is a CUDA graph allocation: its
        # memory exists only once the graph has been launched, and freeing it before that is a CUDA error that
        # PyTorch raises inside the tensor's destructor, which aborts the process. One launch now makes it real,
        # so a cancel or an error between capture and the first token can free it like any other tensor.
        graph.replay()
        self.graph, self.graph_logits = graph, logits

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.rope_scaling).to(self.dtype)[None, None]  # [1, 1, S, head_dim]
        sin = (angles.sin() * self.rope_scaling).to(self.dtype)[None, None]
        if self.query_beta is None:
            query_scale = torch.ones_like(positions, dtype=self.dtype)
        else:
            query_scale = 1 + self.query_beta * torch.log(1 + torch.floor(positions / self.query_beta_span))
        return cos, sin, query_scale.to(self.dtype)[None, None, :, None]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        count = ids.shape[1]
        cos, sin, query_scale = self._rotary(positions)
        hidden = self.model.model.embed_tokens(ids)
        norm = _rms_norm if self.fused else (lambda module, x: module(x))
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = norm(layer.input_layernorm, hidden)
            q = attention.q_proj(x).view(1, count, self.heads, self.head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(1, count, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(1, count, self.kv_heads, self.head_dim).transpose(1, 2)
            q = _rotate(q, cos, sin) * query_scale
            k = _rotate(k, cos, sin)
            self.keys[index].index_copy_(2, positions, k)
            self.values[index].index_copy_(2, positions, v)
            if mask is None:  # prefill from position 0: the new tokens attend causally to each other only
                out = F.scaled_dot_product_attention(q, k, v, is_causal=count > 1, enable_gqa=True)
            elif self.fused and count == 1:  # one query: its heads of one kv group are rows of one attention
                grouped = q.reshape(1, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
                out = F.scaled_dot_product_attention(grouped, self.keys[index], self.values[index], attn_mask=mask)
                out = out.reshape(1, self.heads, 1, self.head_dim)
            else:
                out = F.scaled_dot_product_attention(q, self.keys[index], self.values[index], attn_mask=mask,
                                                     enable_gqa=True)
            hidden = hidden + attention.o_proj(out.transpose(1, 2).reshape(1, count, -1))
            hidden = hidden + layer.mlp(norm(layer.post_attention_layernorm, hidden))
        last = self.model.model.norm(hidden[:, -1:])
        return self.model.lm_head(last)[:, -1].float()


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for every capture: each new stream would get (and keep) its own cuBLAS
    workspace, so a fresh stream per prompt would grow the process's memory by ~32 MB a call."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def _rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' Ministral3RMSNorm, `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`, in two kernels;
    any other norm module runs as it is."""
    eps = getattr(module, "variance_epsilon", None)
    weight = getattr(module, "weight", None)
    if eps is None or weight is None or type(module).__name__ != "Ministral3RMSNorm":
        return module(x)
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
