"""The no-free-lunch study: does AttnRes trade memorisation for structure?

A study beside the package, not part of it: residual MLPs 4-30 blocks deep, with and without
PreNorm, trained on a mix of a structured task and a memorisation task (its own model, tasks
and training loop; it uses ``attnres.nn``'s residual modules and the shared statistics of
``attnres.experiments.stats``, and nothing in ``attnres`` imports it). Run it from the
repository root with the package installed:

    python -m studies.no_free_lunch --out runs/nfl --seeds 0 1 2            # the grid, then report.md
    python -m studies.no_free_lunch --out runs/nfl --report-only            # the report of finished runs

``study`` runs the grid, ``tasks`` and ``models`` define the runs, ``findings`` and ``effects``
compute the report's findings and effect sizes, ``report`` writes ``report.md`` and plots.
Its committed results are in ``studies/no_free_lunch/results/``.
"""
