"""How a run fits the machine: memory estimates, offloading and block streaming, compiling, follower processes for
several GPUs, and the caches that let a repeated run skip work."""
