"""Wire contracts (`package pdserve.v1`) and their generated stubs (`make proto` regenerates)."""
