"""The serving engine: sequences, a pure-Python scheduler, the model runner, sampling, and the step loop."""
