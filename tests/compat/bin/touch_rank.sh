#!/bin/bash
# A program worker: touches DIR/$RANK.
echo "creating $1/$RANK"
touch "$1/$RANK"
