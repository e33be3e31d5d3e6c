"""The decode family's split rule on the host (test/cpp/decode_splits_check.cu):
every key in one non-empty split of whole tiles, no second wave of CTAs,
half the CTA slots at most for a single unmasked token, the workspace's size."""


def test_split_rule_over_a_grid_of_calls(host_check):
    out = host_check("decode_splits_check")
    assert out.strip().splitlines()[-1] == "ok", out
