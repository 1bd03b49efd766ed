"""The ZeRO memory model reproduces the ZeRO paper's Table 1 (fp16 params and grads, K = 12)."""

import pytest

from megazero.optim.memory import memory_report, zero_model_state_bytes

# Per-device model-state memory in GB (1e9 bytes) as printed in the paper: stage 1, 2, 3 columns.
TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}


@pytest.mark.parametrize("psi", sorted(TABLE_1))
@pytest.mark.parametrize("nd", [1, 4, 16, 64, 256, 1024])
def test_reproduces_zero_table_1(psi, nd):
    for stage, printed in zip((1, 2, 3), TABLE_1[psi][nd]):
        got = zero_model_state_bytes(psi, nd, stage).total / 1e9
        digits = len(str(printed).split(".")[1]) if "." in str(printed) else 0
        # The paper rounds to the digits it shows (and to 3 significant figures for large values).
        assert abs(got - printed) <= max(0.5 * 10**-digits, 0.0051 * printed), (stage, got, printed)


def test_plain_data_parallel_is_sixteen_bytes_per_parameter():
    assert zero_model_state_bytes(1e9, 8, 0).total == 16e9
    once = zero_model_state_bytes(1e9, 8, 2, full_grads=True)
    assert once.grads == 2e9 and once.master == 4e9 / 8


def test_report_line_names_rank_and_categories():
    predicted = zero_model_state_bytes(2**30, 2, 1)
    line = memory_report({"params": 2**31, "grads": 2**31, "master": 2**31, "optimizer": 2**32}, predicted, 3, 1)
    assert line.startswith("[rank 3] ZeRO-1") and "params 2.000/2.000" in line and "optimizer 4.000/4.000" in line


def test_report_line_shows_each_category_once_in_order():
    """Every category is on the line, the fp32 master included, and the total is all four against the
    formula's, the moments, the largest, counted too (planted: the master left out of the categories
    listed; the total without the optimizer category; each passed)."""
    predicted = zero_model_state_bytes(2**30, 1, 1)
    line = memory_report({"params": 2**31, "grads": 2**31, "master": 2**32, "optimizer": 2**33}, predicted, 0, 1)
    assert line == ("[rank 0] ZeRO-1 model states, GiB measured/formula: params 2.000/2.000, grads 2.000/2.000, "
                    "master 4.000/4.000, optimizer 8.000/8.000; total 16.000/16.000")
