"""From prompt embeddings to a latent: noise, schedules, reference tokens, inpainting, the plan of a
denoise and the Euler loop."""
