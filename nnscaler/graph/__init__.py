"""The front end: capture (torch.export -> IR), the IR itself, and op annotations."""
