"""Generation: sampling completions from the training policy on its own mesh."""
