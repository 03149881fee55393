"""lit_amp_det.bench.host_probe: the copy probe each bench repeat reads around its timed steps, and its column."""

from __future__ import annotations

from lit_amp_det.bench.host_probe import PROBE_MB, CopyProbe, probe_text


def test_the_probe_reads_a_bandwidth_on_the_cpu_and_nothing_on_cuda() -> None:
    probe = CopyProbe("cpu", megabytes=2)
    readings = [probe.gbps(), probe.gbps(tries=1)]
    assert all(isinstance(r, float) and r > 0 for r in readings)
    assert CopyProbe("cuda").gbps() is None  # no buffers made, no GPU needed
    assert PROBE_MB == 64


def test_the_column_gives_each_repeats_readings_in_run_order() -> None:
    row = {"host_copy_gbps": [35.2, 34.1],  # the aggregate row keeps the first repeat's; the column reads them all
           "repeat_results": [{"host_copy_gbps": [35.2, 34.1]}, {"host_copy_gbps": [52.0, 51.4]},
                              {"host_copy_gbps": [None, None]}, {}]}
    assert probe_text(row) == "35-34 / 52-51 / - / -"
    assert probe_text({"host_copy_gbps": [47.6, 33.4]}) == "48-33"  # a single run: the row itself
