"""The paper's model analyses (Sec. 4.5, App. D.7-D.8): `vitscale inspect`.

`analyses.py` is the maths (pure numpy), `extract.py` reads a model's filters, position table and
attention, `images.py` the sample images, `plots.py` draws the figures, `run.py` writes them all.
"""
