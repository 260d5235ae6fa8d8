"""One module per machine: hardware facts, a Parsl Config factory and the training launch line."""
