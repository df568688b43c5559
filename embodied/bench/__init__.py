"""Benchmarks run by ``embodied bench <name>``: each module has ``run(overrides, iterations, out_dir)``
returning a JSON-able summary and ``markdown(summary)`` rendering its table."""

from envs.common import Registry

BENCHES = Registry("benchmark (embodied bench <name>)")
BENCHES.update({"pipeline": "embodied.bench.pipeline", "overhead": "embodied.bench.overhead"})
