"""What a model is, in the numbers the planner needs: parameters, shapes, context."""
