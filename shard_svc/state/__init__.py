"""Per-sequence state: KDA recurrent + conv state slots, and the paged MLA latent KV cache."""
