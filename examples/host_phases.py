"""Which phase a shared CPU host is in, probe by probe: a memory-copy probe beside one Winograd layer and oneDNN's
direct convolution of the same layer, forward + backward, all in one process.

On the dev VM (2 vCPUs on an AMD EPYC Zen 4 host) a process alternates, every 5-30 s, between two phases that the
copy probe tells apart. In one, a 64 MB copy runs at about 35 GB/s and the Winograd layer (4 x 64 x 64x64, fp32)
takes 15-19 ms against the direct convolution's 17-19 ms. In the other, the copy reads about 52 GB/s (41-61) while
the same Winograd layer takes 27-31 ms (its batched products 1.8x and its input-tile transform 2.3x as long), the
R50-FPN box head's RoIAlign backward 33-35 ms instead of 16-18 and the whole R50 bf16 training step 1.11x as long;
the direct convolution, and the bf16 Winograd layer of the R50 mask head, hardly move. 35 % and 62 % of the probes
of two runs fell in the second phase. The guest cannot see why (a plausible cause: where the hypervisor places the
two vCPUs against the host's L3 caches). It is what earlier sessions called the slow and fast "modes" of whole
processes, and why one run of a one-layer size grid can disagree with the next (BENCHMARKS.md, "Two host phases").

The summary splits the probes into two groups at the widest gap in copy bandwidth (when the two groups' medians
differ by at least ``--split-ratio``) and gives each group's medians: a timing taken on such a host belongs to one
phase or the other, so an A/B has to alternate its arms faster than the phases change, or say which phase each
arm ran in.

    python examples/host_phases.py --seconds 300
    python examples/host_phases.py --seconds 300 --layer 2x256x32x32 --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lit_amp_det.bench.host_probe import PROBE_MB, CopyProbe
from lit_amp_det.models.winograd_conv import winograd_conv3x3
from lit_amp_det.profiling import timed


def layer_ms(convolve, x: torch.Tensor, weight: torch.Tensor, tries: int = 3) -> float:
    """Median ms of ``tries`` forward + backward calls of ``convolve(x, weight)`` (after one untimed call)."""
    def call() -> None:
        out = convolve(x, weight)
        torch.autograd.grad(out, (x, weight), torch.ones_like(out))

    call()
    return statistics.median(1000 * timed(call, "cpu") for _ in range(tries))


def split_at_widest_gap(values: list[float], min_ratio: float) -> float | None:
    """The threshold between the two groups ``values`` fall into, at the widest gap between neighbours in sorted
    order, or None when there are fewer than 2 values on a side or the groups' medians differ by less than
    ``min_ratio``."""
    ordered = sorted(values)
    gaps = [(ordered[i + 1] - ordered[i], i) for i in range(1, len(ordered) - 2)]
    if not gaps:
        return None
    _, i = max(gaps)
    low, high = ordered[:i + 1], ordered[i + 1:]
    if statistics.median(high) < min_ratio * statistics.median(low):
        return None
    return (ordered[i] + ordered[i + 1]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300, help="how long to probe")
    parser.add_argument("--interval", type=float, default=1.0, help="pause between probes, s")
    parser.add_argument("--layer", default="4x64x64x64", help="N x C x H x W of the C -> C 3x3 layer")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--copy-mb", type=int, default=PROBE_MB, help="size of the copy probe's buffer, MB")
    parser.add_argument("--split-ratio", type=float, default=1.2,
                        help="the least ratio of the two groups' median copy bandwidths that counts as two phases")
    args = parser.parse_args()
    try:
        n, c, h, w = (int(v) for v in args.layer.lower().split("x"))
    except ValueError:
        parser.error(f"--layer must be N x C x H x W, like 4x64x64x64; got {args.layer!r}")
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=generator).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(c, c, 3, 3, generator=generator) / (3 * c ** 0.5)).to(dtype)
    x.requires_grad_(), weight.requires_grad_()
    probe = CopyProbe("cpu", megabytes=args.copy_mb)  # the probe every bench train|infer repeat reads
    print(f"{torch.get_num_threads()} threads, copy {args.copy_mb} MB, layer {n}x{c}x{h}x{w} {args.dtype} "
          "channels_last, forward + backward", flush=True)
    probes = []
    end = time.monotonic() + args.seconds
    while True:
        bandwidth = probe.gbps()
        tiles = layer_ms(winograd_conv3x3, x, weight)
        direct = layer_ms(lambda t, k: F.conv2d(t, k, padding=1), x, weight)
        probes.append((bandwidth, tiles, direct))
        print(f"{time.strftime('%H:%M:%S')} copy {bandwidth:5.1f} GB/s | Winograd {tiles:6.2f} ms, direct "
              f"{direct:6.2f} ms, {direct / tiles:.2f}x", flush=True)
        if time.monotonic() >= end:
            break
        time.sleep(args.interval)
    threshold = split_at_widest_gap([p[0] for p in probes], args.split_ratio)
    groups = ([("all probes", probes)] if threshold is None else
              [(f"copy < {threshold:.1f} GB/s", [p for p in probes if p[0] < threshold]),
               (f"copy > {threshold:.1f} GB/s", [p for p in probes if p[0] > threshold])])
    if threshold is None:
        print(f"one phase: no two groups of copy bandwidth {args.split_ratio}x apart")
    for label, group in groups:
        med = [statistics.median(p[i] for p in group) for i in range(3)]
        print(f"{label}: {len(group)} probes, copy {med[0]:.1f} GB/s, Winograd {med[1]:.2f} ms, direct "
              f"{med[2]:.2f} ms, {med[2] / med[1]:.2f}x")


if __name__ == "__main__":
    main()
