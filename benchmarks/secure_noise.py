"""Secure vs seeded randomness: DP-SGD step time and noise alone, in one run.

Measured in interleaved rounds (every variant once per round, in a rotating order) so that
load from other processes hits them alike; medians and ratios are reported:

* the dpfy DP-SGD step of ``benchmarks/dpsgd_step.py`` on its MLP and CNN, with seeded and
  with secure randomness (the step builder is imported from there, not copied);
* noise alone, ``normal_`` with an addend on one flat float32 buffer (the fused path of a
  training step), for 1M and 22.6M values: seeded, secure, and secure with one draw per
  value (no floating-point mitigation: the keystream's own cost);
* raw bits: the AES-256-CTR keystream against NumPy's SFC64 ``random_raw`` (GB/s);
* the device path (docs/randomness.md) run on the CPU: seeded noise from the Philox4x32-10
  generator in torch integer ops (``device_noise=True``) against the host SFC64 path, and
  the host side of secure noise for a device: the keystream words of both draws written
  into the staging buffer plus the deep-tail scan (what the host does per step; on a GPU the
  words then travel by an asynchronous copy, estimated in docs/randomness.md, not measured);
* ``--sections profile``: the stages of one float32 Box-Muller draw of 2M values (the host
  noise block), timed alone on reused buffers: the words (SFC64, AES-256-CTR), the radius
  (bits to float, log, sqrt and the element-wise steps), the angle, cos, sin and the fused
  add; and from them the smallest secure / seeded ratio any two-draw mitigation could reach
  with these kernels (docs/randomness.md, "Costs").

Usage::

    python benchmarks/secure_noise.py [--json benchmarks/results/secure_noise.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpsgd_step  # noqa: E402  (the step builders and the interleaved timer)

import dpfy.randomness as R  # noqa: E402
from dpfy.randomness import Randomness, _Keystream  # noqa: E402

_TWO_PI_2_32 = 2.0 * np.pi * 2.0**-32


def secure_dpfy_step(model, x, y):
    """``dpsgd_step.dpfy_step`` with secure randomness (its rng is built inside)."""
    with mock.patch.object(dpsgd_step, "Randomness", lambda *a, **k: Randomness.secure_mode()):
        return dpsgd_step.dpfy_step(model, x, y)


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for r in range(rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            t0 = clock()
            fns[k]()
            times[k].append(clock() - t0)
    return times


def noise_variants(n: int) -> dict[str, Callable[[], object]]:
    flat, base = torch.empty(n), torch.randn(n)
    seeded, secure, single = Randomness(seed=0), Randomness.secure_mode(), Randomness.secure_mode()
    single._draws = 1  # keystream + transform only, no sum of draws

    def run(rng: Randomness) -> Callable[[], object]:
        return lambda: rng.normal_([flat], [1.0], add=[base])

    return {"seeded": run(seeded), "secure": run(secure), "secure_1draw": run(single)}


def device_variants(n: int) -> dict[str, Callable[[], object]]:
    """The device path on the CPU: Philox seeded noise, and secure words for a device."""
    flat, base = torch.empty(n), torch.randn(n)
    seeded, philox = Randomness(seed=0), Randomness(seed=0, device_noise=True)
    secure = Randomness.secure_mode()
    m = (n + 1) // 2
    scratch = R._DeviceScratch(torch.device("cpu"), m)
    return {
        "seeded": lambda: seeded.normal_([flat], [1.0], add=[base]),
        "seeded_philox": lambda: philox.normal_([flat], [1.0], add=[base]),
        "secure_host_words": lambda: secure._secure_device_words(m, scratch),
    }


def profile_variants(n: int) -> dict[str, Callable[[], object]]:
    """The stages of ``_box_muller32`` on one block of ``n`` values (m = n / 2 pairs)."""
    m = n // 2
    sfc, stream = np.random.SFC64(0), _Keystream()
    words = np.empty(2 * m, dtype=np.int32)
    stream.fill(words)
    bits32 = torch.from_numpy(words)
    bits = torch.empty(m, dtype=torch.int32)
    radius, theta, trig = torch.rand(m) + 0.5, torch.rand(m), torch.empty(m)
    out, add = torch.empty(n), torch.randn(n)
    work = (torch.empty(m, dtype=torch.int32), torch.empty(m), torch.empty(m))
    return {
        "words_sfc64": lambda: sfc.random_raw(m),
        "words_aes_ctr": lambda: stream.fill(words),
        "radius_bits": lambda: radius.copy_(torch.bitwise_and(bits32[:m], 0x7FFFFFFF, out=bits)),
        "radius_affine": lambda: radius.add_(0.5).mul_(0.5),  # (k + 1/2) 2^-31, then x -2
        "radius_log": lambda: torch.log(radius, out=trig),
        "radius_sqrt": lambda: torch.sqrt(radius, out=trig),
        "angle": lambda: theta.copy_(bits32[m:]).mul_(_TWO_PI_2_32),
        "cos": lambda: torch.cos(theta, out=trig),
        "sin": lambda: torch.sin(theta, out=trig),
        "fused_add_first": lambda: torch.addcmul(add[:m], trig, radius, value=0.5, out=out[:m]),
        "fused_add_second": lambda: out[:m].addcmul_(trig, radius, value=0.5),
        "tail_scan": lambda: int(bits.min()),
        "transform": lambda: R._box_muller32(bits32, out, *work, std=0.5, add=add),
    }


def profile_floor(med: dict[str, float]) -> dict[str, float]:
    """What the stages imply (milliseconds per block, from the medians).

    seeded = SFC64 words + transform; secure = two draws, each AES words + transform (+ the
    deep-tail scan); floor = the first secure draw as it is, and a second independent 2-D
    draw reduced to what it cannot skip: its words, one log and one sqrt per pair, cos, sin and
    one add per value (no conversions, no scaling): a lower bound for any sum of two
    independent Box-Muller draws with these kernels.
    """
    seeded = med["words_sfc64"] + med["transform"]
    first = med["words_aes_ctr"] + med["transform"] + med["tail_scan"]
    second_floor = (
        med["words_aes_ctr"] + med["radius_log"] + med["radius_sqrt"] + med["cos"] + med["sin"]
        + 2 * med["fused_add_second"]
    )
    return {
        "seeded_ms": seeded,
        "secure_ms": 2 * first,
        "secure_one_draw_ms": first,
        "second_draw_floor_ms": second_floor,
        "ratio_secure": 2 * first / seeded,
        "ratio_floor": (first + second_floor) / seeded,
    }


def bits_variants(nbytes: int) -> dict[str, Callable[[], object]]:
    stream, sfc = _Keystream(), np.random.SFC64(0)
    buf = np.empty(nbytes, dtype=np.uint8)
    return {"aes_ctr": lambda: stream.fill(buf), "sfc64": lambda: sfc.random_raw(nbytes // 8)}


def summary(times: dict[str, list[float]], ref: str) -> dict[str, dict[str, float]]:
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        k: {"median_ms": 1e3 * m, "ratio_to_" + ref: m / med[ref], "samples": len(times[k])}
        for k, m in med.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--noise-rounds", type=int, default=15)
    parser.add_argument("--device-rounds", type=int, default=5)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or process CPU time (steadier when other processes load the machine)",
    )
    parser.add_argument(
        "--sections",
        default="step,noise,device,bits",
        help="comma-separated subset of step,noise,device,bits,profile to run",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections <= {"step", "noise", "device", "bits", "profile"}:
        parser.error(
            f"--sections must name step, noise, device, bits or profile, got {args.sections!r}"
        )
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    report: dict = {
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "batch": args.batch,
        "clock": args.clock,
        "load_average_at_start": os.getloadavg(),
        "note": "wall-clock medians of interleaved rounds on a shared machine",
    }
    builders = {"plain": dpsgd_step.plain_step, "seeded": dpsgd_step.dpfy_step,
                "secure": secure_dpfy_step}
    report["step"] = {}
    for model in dpsgd_step.MODELS if "step" in sections else ():
        res = dpsgd_step.measure(
            model, list(builders), batch=args.batch, rounds=args.rounds, steps=2, warmup=3,
            max_seconds=1e9, builders=builders, clock=clock,
        )
        for r in res.values():
            r["ratio_to_seeded"] = r["median_ms"] / res["seeded"]["median_ms"]
        report["step"][model] = res
    report["noise"] = {}
    for n in (1_000_000, 22_600_000) if "noise" in sections else ():
        fns = noise_variants(n)
        for f in fns.values():
            f()  # warm-up: buffers
        report["noise"][str(n)] = summary(interleaved(fns, args.noise_rounds, clock), "seeded")
    report["device_path_on_cpu"] = {}
    for n in (1_000_000, 22_600_000) if "device" in sections else ():
        fns = device_variants(n)
        for f in fns.values():
            f()
        times = interleaved(fns, args.device_rounds, clock)
        report["device_path_on_cpu"][str(n)] = summary(times, "seeded")
    report["profile"] = {}
    if "profile" in sections:
        n = R.NOISE_BLOCK
        fns = profile_variants(n)
        for f in fns.values():
            f()
        res = summary(interleaved(fns, args.noise_rounds, clock), "transform")
        report["profile"] = {"values": n, "stages": res, "implied": profile_floor(
            {k: r["median_ms"] for k, r in res.items()}
        )}
    nbytes = 4 * 22_600_000
    fns = bits_variants(nbytes) if "bits" in sections else {}
    times = interleaved(fns, args.noise_rounds, clock) if fns else {}
    report["bits"] = summary(times, "sfc64") if fns else {}
    for r in report["bits"].values():
        r["GB_per_s"] = nbytes / (r["median_ms"] * 1e-3) / 1e9

    print(f"\nDP-SGD step (batch {args.batch}, {args.threads} threads, {args.clock} clock)")
    print(f"  {'model':6s} {'variant':8s} {'median ms':>10s} {'x seeded':>9s} {'x plain':>8s}")
    for model, res in report["step"].items():
        for k, r in res.items():
            print(f"  {model:6s} {k:8s} {r['median_ms']:10.2f} {r['ratio_to_seeded']:9.3f} "
                  f"{r['ratio_to_plain']:8.3f}")
    print("\nnoise alone (normal_ with add on one flat float32 buffer)")
    print(f"  {'values':>10s} {'variant':13s} {'median ms':>10s} {'x seeded':>9s}")
    for n, res in report["noise"].items():
        for k, r in res.items():
            print(f"  {int(n):10d} {k:13s} {r['median_ms']:10.2f} {r['ratio_to_seeded']:9.3f}")
    print("\ndevice path on the CPU (Philox seeded noise; host side of secure device noise)")
    print(f"  {'values':>10s} {'variant':17s} {'median ms':>10s} {'x seeded':>9s}")
    for n, res in report["device_path_on_cpu"].items():
        for k, r in res.items():
            print(f"  {int(n):10d} {k:17s} {r['median_ms']:10.2f} {r['ratio_to_seeded']:9.3f}")
    if report["profile"]:
        print(f"\none float32 Box-Muller draw of {report['profile']['values']} values, by stage")
        for k, r in report["profile"]["stages"].items():
            print(f"  {k:17s} {r['median_ms']:8.3f} ms")
        for k, v in report["profile"]["implied"].items():
            print(f"  {k:21s} {v:8.3f}")
    print(f"\nraw bits ({nbytes / 1e6:.0f} MB)")
    for k, r in report["bits"].items():
        print(f"  {k:8s} {r['median_ms']:8.2f} ms {r['GB_per_s']:6.2f} GB/s")
    if args.json:
        dpsgd_step.write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
