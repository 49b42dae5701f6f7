"""The command line: all argparse and printing. Every command is a client of the engine's socket API
(or, for the planner and the hardware commands, of the library directly).

`entry` holds the top-level parser and `main`; `commands` the job and engine commands; `plan` `rigpilot plan`.
"""
