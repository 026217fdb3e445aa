"""The scaling study's Ray-free parts: grids of (model x epochs x data size) pre-trained and
transferred, to compute-vs-accuracy tables, frontiers and fits (the paper's Sec. 4.3-4.4, Table 6,
Figures 3-5).

- `config.py`: the `study:` section (cells, transfer protocols, budget, device and price);
- `cells.py`: a cell and its stable id (the pipeline building is `stages/study_cells.py`);
- `plan.py`, `costs.py`: each cell's compute, device-hours, wall time and cost before anything runs;
- `state.py`: one JSON file per cell in the study directory (local or s3://): skip, resume, retry;
- `fit.py`, `uncertainty.py`: the frontier, the saturating power law, bootstrap intervals,
  identifiability warnings and the backtest (pure);
- `report.py`, `plots.py`, `recommend.py`: the tables, the Figure-5 and Sec.-4.3 plots, `recommend`.

Cells run on Ray in `stages/study_runner.py`; nothing here imports Ray.
"""
