"""MLA (multi-head latent attention, no rotary) ops over the paged latent cache."""
