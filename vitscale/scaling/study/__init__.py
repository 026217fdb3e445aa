"""The scaling study: grids of (model x epochs x data size) pre-trained and transferred, to
compute-vs-accuracy tables, frontiers and fits (the paper's Sec. 4.3-4.4, Table 6, Figures 3-5).

- `config.py`: the `study:` section (cells, transfer protocols, budget);
- `cells.py`: the cells as pipelines of the existing stages (pretrain, fewshot, finetune, sweep);
- `plan.py`: each cell's compute before anything runs (`scaling/flops.py`, as `vitscale flops`);
- `state.py`: one JSON file per cell in the study directory (local or s3://): skip, resume, retry;
- `runner.py`: cells on Ray, as many at once as the cluster fits, with live progress;
- `fit.py`: the Pareto frontier and the saturating power law E = a (C + d)^-b + c (pure);
- `report.py`, `plots.py`: the table, the Figure-5 and Sec.-4.3 plots, `recommend`.
"""
