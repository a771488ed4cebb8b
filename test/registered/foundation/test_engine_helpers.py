"""specpatch.engine's benchmark helper, on a fake engine: what it times and what it returns."""

from __future__ import annotations

from specpatch import engine as eng


class _FakeEngine:
    """Answers generate() like sglang's Engine; records each call's max_new_tokens."""

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, input_ids, sampling_params):
        n = sampling_params["max_new_tokens"]
        self.calls.append(n)
        return [{"output_ids": [0] * n, "meta_info": {"completion_tokens": n, "spec_verify_ct": 1}} for _ in input_ids]


def test_best_of_warms_up_at_full_length_then_times_each_repeat(monkeypatch):
    fake = _FakeEngine()
    clock = iter([0.0, 0.5, 10.0, 13.0, 20.0, 21.0, 30.0, 32.0])  # warm-up 0.5 s, then 3 s, 1 s, 2 s
    monkeypatch.setattr(eng.time, "perf_counter", lambda: next(clock))

    best = eng.best_of(fake, [[1, 2], [3]], max_new_tokens=64, repeats=3)

    assert fake.calls == [64, 64, 64, 64]  # one untimed full-length run, then the repeats
    assert best.seconds == 1.0  # the fastest repeat, not the warm-up
    assert best.completion_tokens == 128
