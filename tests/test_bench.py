"""tuner.bench on the CPU: the HBM floor's bytes and where a row's config came from (the
bench itself times kernels on a GPU)."""

from helpers import dispatch_file

from kernel import KernelConfig, Problem
from kernel.dispatch import load_dispatch
from tuner.bench import served_by, traffic_bytes


def test_traffic_of_the_headline_shape():
    # 537 MB of HBM traffic at B=8, H=16, S=4096, DK=DV=128, fp16
    assert traffic_bytes(Problem(8, 16, 4096, 128, 128, 0.99)) == 536_870_912


def test_bench_rows_say_which_entry_served_a_shape(tmp_path):
    table = load_dispatch(
        dispatch_file(tmp_path, [(Problem(1, 8, 32768, 128, 128, 0.99), KernelConfig(64, 128, 2, 256))])
    )
    assert served_by(table, Problem(1, 8, 32768, 128, 128, 0.9)) == "dispatch table: tuned at this shape"
    assert served_by(table, Problem(1, 4, 65536, 128, 128, 0.99)).endswith("the entry tuned at 1x8x32768")
