"""FLUX 3 Image Klein's prompt upsampler: the model run (model.py), its box protocol (``families/flux3/upsampler_rows.py``), its pictures
(pictures.py)."""
