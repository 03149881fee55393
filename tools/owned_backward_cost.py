"""What the deterministic RoIAlign backward costs on a GPU against the atomic one, counted without a GPU.

The box head's backward at R50-FPN 800x1333, batch 8 (7x7 bins, sampling ratio 2, 512 RoIs an image, 256
channels, one launch per FPN level), with RoIs of log-uniform sizes from 16 to 700 pixels assigned to levels
by torchvision's rule. Per launch shape it prints the programs (each a warp or more, see ``make gpu-compile``
for their registers) and the longest chain of dependent read-add-write steps one program walks: the serial
owned kernel (one program per image and channel block), the tiled one at several tile sizes, and the atomic
kernel (one program per RoI and channel block, every step an atomic add). The tiled kernel's programs also
check every RoI of the launch.

    python tools/owned_backward_cost.py
"""

from __future__ import annotations

import math

import torch

IMAGES, ROIS, CHANNELS, POOL, SAMPLES, CORNERS = 8, 512, 256, 7, 2, 4
HEIGHT, WIDTH = 800, 1333
OWNED_CHANNELS, ATOMIC_CHANNELS = (
    32,
    8,
)  # channels a program: _launch._owned_blocks, _launch._blocks at 7x7 x 256


def _rois(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    n = IMAGES * ROIS
    size = torch.exp(torch.empty(n).uniform_(math.log(16), math.log(700), generator=generator))
    aspect = torch.exp(torch.empty(n).uniform_(-0.7, 0.7, generator=generator))
    h, w = size * aspect.sqrt(), size / aspect.sqrt()
    y = torch.rand(n, generator=generator) * (HEIGHT - h).clamp(min=1)
    x = torch.rand(n, generator=generator) * (WIDTH - w).clamp(min=1)
    level = (4 + torch.log2(torch.sqrt(h * w) / 224 + 1e-6)).floor().clamp(2, 5).long() - 2
    return torch.arange(IMAGES).repeat_interleave(ROIS), level, y, x, h, w


def _bins_reaching(
    start: torch.Tensor, bin_size: torch.Tensor, first: torch.Tensor, tile: int
) -> torch.Tensor:
    """[RoIs, tiles]: how many of each RoI's bins along one axis reach each tile (the kernel's rule, no
    slack).
    """
    b = torch.arange(POOL, dtype=start.dtype)
    low = start[:, None, None] + b[None, None, :] * bin_size[:, None, None]
    reaches = (low + bin_size[:, None, None] >= first[None, :, None] - 1) & (
        low <= first[None, :, None] + tile
    )
    return reaches.sum(-1)


def costs(tiles: tuple[int, ...] = (8, 16, 32)) -> list[tuple[str, int, int]]:
    """(kernel, programs, longest chain of steps) summed over the four level launches."""
    image, level, y, x, h, w = _rois(torch.Generator().manual_seed(0))
    rows = {"serial owned": [0, 0], "atomic": [0, 0], **{f"owned, {t}-pixel tiles": [0, 0] for t in tiles}}
    steps_per_bin = SAMPLES * SAMPLES * CORNERS
    for lvl in range(4):
        scale = 2.0 ** -(lvl + 2)
        height, width = math.ceil(HEIGHT * scale), math.ceil(WIDTH * scale)
        mine = level == lvl
        per_image = torch.bincount(image[mine], minlength=IMAGES)
        rows["serial owned"][0] += IMAGES * CHANNELS // OWNED_CHANNELS
        rows["serial owned"][1] += int(per_image.max()) * POOL * POOL * steps_per_bin
        rows["atomic"][0] += int(mine.sum()) * CHANNELS // ATOMIC_CHANNELS
        rows["atomic"][1] += steps_per_bin if mine.any() else 0
        for tile in tiles:
            ty, tx = math.ceil(height / tile), math.ceil(width / tile)
            rows_y = _bins_reaching(
                y[mine] * scale, h[mine] * scale / POOL, torch.arange(ty) * float(tile), tile
            )
            cols_x = _bins_reaching(
                x[mine] * scale, w[mine] * scale / POOL, torch.arange(tx) * float(tile), tile
            )
            work = torch.zeros(IMAGES, ty, tx)
            work.index_add_(0, image[mine], (rows_y[:, :, None] * cols_x[:, None, :]).float() * steps_per_bin)
            key = f"owned, {tile}-pixel tiles"
            rows[key][0] += IMAGES * ty * tx * CHANNELS // OWNED_CHANNELS
            rows[key][1] += int(work.max())
    return [(name, programs, chain) for name, (programs, chain) in rows.items()]


def main() -> None:
    print("| kernel | programs | longest chain (steps) | RoI checks a program |")
    print("|---|---:|---:|---:|")
    for name, programs, chain in costs():
        checks = f"{IMAGES * ROIS:,}" if "tiles" in name else "0"
        print(f"| {name} | {programs:,} | {chain:,} | {checks} |")


if __name__ == "__main__":
    main()
