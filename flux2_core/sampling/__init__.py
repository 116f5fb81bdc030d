"""From prompt embeddings to a latent: the latent grid, noise, schedules, reference tokens, inpainting, the plan of a
denoise and the Euler loop."""
