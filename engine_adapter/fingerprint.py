"""A fingerprint of a model's weights, for the store namespace of the KV it produces.

Two checkpoints of one config (a fine-tune, a new release, another random seed) compute different
KV for the same tokens, so they must never share a namespace (DESIGN.md section 5), whatever name
they are served under. Hashing every byte of a large checkpoint would cost a full read of it at
every start. The fingerprint hashes instead, for every tensor of the state dict in name order, its
name, dtype and shape, and ``SAMPLES`` of its elements spread evenly over it (all of them when it
is smaller).

A fine-tune, merged LoRA adapters included, changes nearly every element of the tensors it
touches, so the samples catch it. A change confined to elements between the samples would not be
caught; a caller that needs certainty passes its own ``weights_hash`` (a checkpoint revision, a
hash of the files) to ``Engine`` or ``namespace_for``.

Cost: two small gathers per tensor and one copy to the host. 45,000 tensors (DeepSeek-V3 with
its experts as separate tensors has about that many) took 2.0 s on this machine's CPU; on a GPU
it is a few kernel launches per tensor (not measured there).
"""

from __future__ import annotations

import torch
import xxhash

SAMPLES = 64  # elements per tensor


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """32 hex digits: xxh3-128 over every tensor's name, dtype, shape and sampled elements.

    Equal for equal weights in the same dtypes on any device; one copy to the host in all.
    """
    digest = xxhash.xxh3_128()
    samples = []  # [k * itemsize] uint8 per tensor, on the model's device
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)};".encode())
        if tensor.numel():
            samples.append(_sample(tensor).view(torch.uint8))
    if samples:
        digest.update(torch.cat(samples).cpu().numpy().tobytes())
    return digest.hexdigest()


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """[min(numel, SAMPLES)] elements evenly spaced over the tensor in row-major order."""
    n = tensor.numel()
    k = min(n, SAMPLES)
    positions = [i * (n - 1) // (k - 1) for i in range(k)] if k > 1 else [0]  # exact integers on any device
    return torch.take(tensor, torch.tensor(positions, device=tensor.device)).contiguous()
