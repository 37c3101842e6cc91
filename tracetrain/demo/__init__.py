"""`tracetrain demo`: the arithmetic agent learning from its own traffic (`run`), and the agent itself
(`arithmetic`), shipped inside the package so that an installed tracetrain runs the demo as is."""
