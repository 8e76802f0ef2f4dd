"""The side-by-side benchmark report: every suite in ``benchmarks/``, modstate beside its peers.

Run it from a source checkout (it is not part of the installed package, which does not ship the
suites): ``python -m modstate bench [...]`` forwards here, as does ``python benchmarks/report
[...]``. Each suite runs under pytest-benchmark in a subprocess of its own, with a progress line
per suite; the report pairs the cases (`results`), prints them as a table (`text`), and writes
``bench.txt``, ``bench.json`` (every figure and ratio, plus each benchmark's statistics) and
``bench.png`` (`chart`; needs matplotlib) to ``--out``; ``--page`` also rewrites the docs page's
headline and tables (`page`). A new suite or case needs no edit here: cases are found by their
``benchmark.group`` and ``extra_info["impl"]``, families by their suite's file name.

- ``suites``: finding the suites and running each one;
- ``results``: pairing the figures into cases, per family;
- ``text``, ``chart``, ``page``: the table, the chart, the docs page's Markdown;
- ``cli``: the command.
"""
