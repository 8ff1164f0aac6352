"""KDA (Kimi Delta Attention) ops: gate, recurrent reference, chunked eager prefill, eager decode."""
