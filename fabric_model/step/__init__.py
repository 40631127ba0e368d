"""What a step is: the plan of samples, the flat step buffer, how its sums are made and
read, and the state a worker carries between steps (docs/architecture.md, "The step")."""
