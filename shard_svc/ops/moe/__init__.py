"""MoE ops: sigmoid top-k routing and the routed-expert computation."""
