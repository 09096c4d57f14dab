"""Fast token-by-token decoding for a prompt enhancer whose weights are all on one CUDA device.

transformers' eager decode spends ~26 ms per token of a 3.4B model on the H200, almost all of it launching about
1,400 small kernels from Python; reading the weights once takes ~1.6 ms. This decoder keeps the KV cache in fixed
buffers (one slot per position, later slots masked out) so every token runs the same kernels on the same
addresses, and replays them as one CUDA graph per token.

The maths is Ministral3's (transformers' modeling_ministral3): RMSNorm, q/k/v, YaRN rotary tables from the
model's own `rotary_emb`, the Llama-4 query scaling by position, grouped-query SDPA, SiLU MLP, tied head. The
model's own submodules do the projections and MLP, so quantised Linears work unchanged.

`fused` (the default) issues fewer, larger kernels for the same maths, each within float rounding of
transformers' (the tests' bounds). A decode step (one token) runs about 17 kernels a layer where transformers
issues about 50: each RMSNorm is one `F.rms_norm` kernel with its weight; q, k and v come out side by
side in one row from one GEMV (on a GPU their weights become views of one stacked tensor, `stack_weights_`; the
same for the MLP's gate and up), so RoPE (the Llama-4 query scaling folded into the query rows' tables) rotates q and k
in three kernels and one `index_copy_` stores k and v in the cache; the attention runs the query heads of each
key/value head as rows of one plain SDPA call (grouped-query SDPA with a mask falls back to the math kernels, which
first copy every cached key and value once per query head group); the residual adds ride in the output
projections' GEMVs (`addmm`); SiLU and the gate product run in place. The CPU and streamed prompt enhancers keep
transformers' path (the reference the tests compare with).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..model.cuda_capture import capture_stream, heal_generator_after_failed_capture, host_syncs_raise
from ..model.graph_memory import give_back_graph_memory

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

    def __init__(self, model: nn.Module, capacity: int, use_graph: bool, fused: bool = True,
                 compiled: bool = False) -> None:
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
        # keys and values side by side, so one index_copy_ stores both of a layer's new entries
        self.cache = torch.zeros((len(self.layers), 2, self.kv_heads, self.capacity, self.head_dim),
                                 device=self.device, dtype=self.dtype)
        self.keys, self.values = self.cache[:, 0:1], self.cache[:, 1:2]  # [layers, 1, kv_heads, slots, head_dim]
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.to(device=self.device, dtype=torch.float32)
        self.rope_scaling = float(rotary.attention_scaling)
        rope = config.rope_parameters or {}
        self.query_beta = rope.get("llama_4_scaling_beta")
        self.query_beta_span = rope.get("original_max_position_embeddings")
        self.slots = torch.arange(self.capacity, device=self.device)
        self.step_tables = _StepTables(self) if fused else None
        self.eps = float(model.model.layers[0].input_layernorm.variance_epsilon) if fused else 0.0
        if fused and use_graph:
            for layer in self.layers:
                stack_weights_([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                stack_weights_([layer.mlp.gate_proj, layer.mlp.up_proj])
        # One compiled function serves every layer (its weights are arguments), when every layer is plain and stacked.
        self.layer_tensors = _plain_layer_tensors(self.layers) if fused and compiled else None
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
        device = self.graph_logits.device if self.graph_logits is not None else None
        self.graph_logits = None
        self.graph = None
        self.keys = self.values = self.cache = self.step_tables = None
        if device is not None:
            give_back_graph_memory(device)

    def _decode_step(self) -> torch.Tensor:
        mask = (self.slots <= self.position)[None, None, None, :]  # slots past this token hold stale keys
        if self.fused:
            return self._fused_decode_step(mask)
        return self._forward(self.token, self.position, mask)

    def _fused_decode_step(self, mask: torch.Tensor) -> torch.Tensor:
        """One token through every layer in few kernels (module docstring); hidden states are [1, hidden]."""
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        cos, signed_sin = self.step_tables.at(self.position)  # [q+kv heads (+kv heads), head_dim] fp32
        rotated_rows = self.heads + self.kv_heads
        half = self.head_dim // 2
        hidden = self.model.model.embed_tokens(self.token)[0]
        if self.layer_tensors is not None:
            step = _compiled_decode_layer()
            for index, tensors in enumerate(self.layer_tensors):
                hidden = step(hidden, *tensors, self.cache[index], self.position, cos, signed_sin, mask,
                              self.heads, self.kv_heads, self.eps)
            last = self.model.model.norm(hidden[None])
            return self.model.lm_head(last)[:, -1].float()
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = _rms_norm_weighted(layer.input_layernorm, hidden)
            qkv = torch.empty((1, q_width + 2 * kv_width), device=self.device, dtype=self.dtype)
            _project_stacked_into([attention.q_proj, attention.k_proj, attention.v_proj], x, qkv)
            heads = qkv.view(-1, self.head_dim)  # q heads, then k heads, then v heads
            rows = torch.mul(heads, cos, out=torch.empty_like(heads))  # v rows: cos is exactly 1
            rows[:rotated_rows, :half].addcmul_(heads[:rotated_rows, half:], signed_sin[:, :half])
            rows[:rotated_rows, half:].addcmul_(heads[:rotated_rows, :half], signed_sin[:, half:])
            self.cache[index].index_copy_(2, self.position, rows[self.heads:].view(2, self.kv_heads, 1, -1))
            grouped = rows[:self.heads].view(1, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
            out = F.scaled_dot_product_attention(grouped, self.cache[index, 0:1], self.cache[index, 1:2],
                                                 attn_mask=mask)
            hidden = _project_added(attention.o_proj, out.reshape(1, q_width), hidden)
            mlp = layer.mlp
            x = _rms_norm_weighted(layer.post_attention_layernorm, hidden)
            width = mlp.gate_proj.out_features
            gate_up = torch.empty((1, 2 * width), device=self.device, dtype=self.dtype)
            _project_stacked_into([mlp.gate_proj, mlp.up_proj], x, gate_up)
            activated = F.silu(gate_up[:, :width], inplace=True).mul_(gate_up[:, width:])
            hidden = _project_added(mlp.down_proj, activated, hidden)
        last = self.model.model.norm(hidden[None])
        return self.model.lm_head(last)[:, -1].float()

    def _capture(self) -> None:
        # Warm-up and capture write stale keys at slot 0; prefill overwrites them before anything reads them.
        side = capture_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._decode_step()  # compiles the step where it is compiled (autotuning waits for the device)
            with host_syncs_raise():  # a step that waits for the host must not be captured (see host_syncs_raise)
                self._decode_step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread is barred from unsafe CUDA calls while it captures, not the host app's others
        try:
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                logits = self._decode_step()
        except BaseException:
            heal_generator_after_failed_capture(self.device)
            raise
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
        norm = _rms_norm_weighted if self.fused else (lambda module, x: module(x))
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


def _plain_layer_tensors(layers) -> Optional[list[tuple[torch.Tensor, ...]]]:
    """Per layer (input norm weight, stacked q/k/v weight, o weight, post norm weight, stacked gate/up weight, down
    weight), or None when a layer has a quantised or unstacked projection or another norm."""
    tensors = []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        qkv = _stacked_weight([attention.q_proj, attention.k_proj, attention.v_proj])
        gate_up = _stacked_weight([mlp.gate_proj, mlp.up_proj])
        o_weight, down_weight = _plain_weight(attention.o_proj), _plain_weight(mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (qkv is None or gate_up is None or o_weight is None or down_weight is None
                or any(type(norm).__name__ != "Ministral3RMSNorm" for norm in norms)):
            return None
        tensors.append((norms[0].weight, qkv, o_weight, norms[1].weight, gate_up, down_weight))
    return tensors


def decode_layer(hidden: torch.Tensor, input_norm: torch.Tensor, qkv_weight: torch.Tensor, o_weight: torch.Tensor,
                 post_norm: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                 cache: torch.Tensor, position: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 mask: torch.Tensor, heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """One decoder layer for one token as a pure function of its tensors (what `torch.compile` fuses): the same
    maths as the fused step, hidden [1, hidden], cache [2, kv_heads, slots, head_dim] (k and v, updated in place)."""
    head_dim = cos.shape[-1]
    half, rotated = head_dim // 2, heads + kv_heads
    x = F.rms_norm(hidden, (hidden.shape[-1],), weight=input_norm, eps=eps)
    rows = torch.mm(x, qkv_weight.t()).view(-1, head_dim)
    lo = rows[:rotated, :half] * cos[:rotated, :half] + rows[:rotated, half:] * signed_sin[:, :half]
    hi = rows[:rotated, half:] * cos[:rotated, half:] + rows[:rotated, :half] * signed_sin[:, half:]
    rows = torch.cat((torch.cat((lo, hi), dim=-1).to(rows.dtype), rows[rotated:]))
    cache.index_copy_(2, position, rows[heads:].view(2, kv_heads, 1, head_dim))
    grouped = rows[:heads].view(1, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, cache[0:1], cache[1:2], attn_mask=mask)
    hidden = torch.addmm(hidden, out.reshape(1, -1), o_weight.t())
    x = F.rms_norm(hidden, (hidden.shape[-1],), weight=post_norm, eps=eps)
    gate_up = torch.mm(x, gate_up_weight.t())
    width = gate_up.shape[-1] // 2
    return torch.addmm(hidden, F.silu(gate_up[:, :width]) * gate_up[:, width:], down_weight.t())


@functools.cache
def _compiled_decode_layer():
    """`decode_layer` through torch.compile, made once (the allocator backend is fixed for the process). Under cudaMallocAsync (current ComfyUI's
    allocator) a tensor allocated inside a CUDA-graph capture has no memory until the graph first runs, and
    Inductor's Python kernel launchers check every tensor argument with the driver (cuPointerGetAttribute: "invalid
    argument" mid-capture, then an abort when the failed capture's tensors are freed); its C++ wrapper passes the
    pointers on unchecked, so there the step is compiled with it (needs a C++ compiler, as Triton does)."""
    backend = torch.cuda.get_allocator_backend() if torch.cuda.is_available() else "native"
    options = {"cpp_wrapper": True} if backend == "cudaMallocAsync" else None
    return torch.compile(decode_layer, fullgraph=True, options=options)


def _rms_norm_weighted(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' Ministral3RMSNorm in one kernel, its weight product rounded together with the norm."""
    eps = getattr(module, "variance_epsilon", None)
    weight = getattr(module, "weight", None)
    if eps is None or weight is None or type(module).__name__ != "Ministral3RMSNorm":
        return module(x)
    return F.rms_norm(x, (x.shape[-1],), weight=weight, eps=eps)


def _plain_weight(linear: nn.Module) -> Optional[torch.Tensor]:
    """The weight of a bias-free nn.Linear (not a quantised or wrapped one), else None."""
    if type(linear) is nn.Linear and linear.bias is None:
        return linear.weight
    return None


def _project_into(linear: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = linear(x), written in place (out: a contiguous row slice)."""
    weight = _plain_weight(linear)
    if weight is None:
        out.copy_(linear(x))
    else:
        torch.mm(x, weight.t(), out=out)


def _project_stacked_into(linears: list[nn.Module], x: torch.Tensor, out: torch.Tensor) -> None:
    """out = the linears' outputs side by side: one GEMV when their weights are views of one stacked tensor
    (`stack_weights_`: a one-row product reaches 3.6-3.8 TB/s on the stacked shapes, 1.0-3.0 on the parts), else
    one per linear."""
    stacked = _stacked_weight(linears)
    if stacked is not None:
        torch.mm(x, stacked.t(), out=out)
        return
    start = 0
    for linear in linears:
        width = linear.out_features
        _project_into(linear, x, out[:, start:start + width])
        start += width


def stack_weights_(linears: list[nn.Module]) -> bool:
    """Make plain bias-free Linears that share an input hold views of one stacked weight (rows in order), without
    changing what they compute; the separate tensors are freed, so the memory stays the same. False (nothing
    changed) when any of them is not a plain Linear or their weights differ in dtype, device or input width."""
    weights = [_plain_weight(linear) for linear in linears]
    if any(weight is None for weight in weights):
        return False
    if len({(weight.dtype, weight.device, weight.shape[1]) for weight in weights}) != 1:
        return False
    if _stacked_weight(linears) is not None:
        return True
    with torch.no_grad():
        stacked = torch.cat([weight.detach() for weight in weights])
    start = 0
    for linear, weight in zip(linears, weights):
        linear.weight = nn.Parameter(stacked[start:start + weight.shape[0]], requires_grad=False)
        start += weight.shape[0]
    return True


def _stacked_weight(linears: list[nn.Module]) -> Optional[torch.Tensor]:
    """The stacked weight the linears' weights are consecutive row views of, or None."""
    weights = [_plain_weight(linear) for linear in linears]
    if any(weight is None for weight in weights):
        return None
    first = weights[0]
    rows = sum(weight.shape[0] for weight in weights)
    offset = first.storage_offset()
    for weight in weights:
        if (weight.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not weight.is_contiguous()
                or weight.storage_offset() != offset or weight.shape[1] != first.shape[1]):
            return None
        offset += weight.numel()
    return first.as_strided((rows, first.shape[1]), first.stride(), first.storage_offset())


def _project_added(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x), the add inside the GEMV for a plain Linear."""
    weight = _plain_weight(linear)
    if weight is None:
        return residual + linear(x)
    return torch.addmm(residual, x, weight.t())


class _StepTables:
    """A decode step's RoPE factors for every row of the step's q, k, v heads, per position: the query rows carry
    the Llama-4 scaling, v rows have cos 1 and no sine; built once per decoder, looked up on the device."""

    def __init__(self, decoder: "StaticCacheDecoder") -> None:
        positions = torch.arange(decoder.capacity, device=decoder.device)
        cos, sin, query_scale = decoder._rotary(positions)  # [1, 1, slots, head_dim] in the model dtype
        cos, sin = cos[0, 0].float(), sin[0, 0].float()
        half = cos.shape[-1] // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half's sign folded in
        self.cos = cos
        self.query_scale = query_scale.reshape(-1).float()  # [slots]
        self.heads, self.kv_heads = decoder.heads, decoder.kv_heads
        self.is_query = (torch.arange(decoder.heads + decoder.kv_heads, device=decoder.device) < decoder.heads)[:, None]
        self.v_rows = torch.ones((decoder.kv_heads, cos.shape[-1]), device=decoder.device)

    def at(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos for the q, k and v rows and signed sin for the q and k rows at `position` (a device tensor [1])."""
        scale = torch.where(self.is_query, self.query_scale[position], 1.0)  # [q+k heads, 1]
        cos = self.cos[position] * scale
        return torch.cat((cos, self.v_rows)), self.signed_sin[position] * scale


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
