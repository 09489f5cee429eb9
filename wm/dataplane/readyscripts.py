"""The ready list's Lua scripts (``wm.dataplane.transport``'s docstring says what the ready
list is): a publish's push, a node's take of the next message, listing a queue again and
repairing the list, and merging the lists of priority levels a node does not read."""

from __future__ import annotations

from wm.dataplane.liveness import HOLD
from wm.dataplane.placement import PLACE
from wm.dataplane.takenfacts import FACTS

#: Messages one merge script moves at most, so a long list never blocks Redis for long.
MERGE_BATCH = 10_000
#: Queues whose lists one merge script looks at (each with up to nine unread levels).
MERGE_QUEUES_PER_CALL = 100
# KEYS: (list of an unread level, list it goes to) pairs, lower levels first. ARGV: most
# messages to move. RPOPLPUSH takes the oldest message (kombu pops from the right) and puts
# it behind everything waiting in the target: FIFO within a level, lower levels first.
MERGE = """
local moved, limit = 0, tonumber(ARGV[1])
for i = 1, #KEYS, 2 do
  while moved < limit and redis.call('RPOPLPUSH', KEYS[i], KEYS[i + 1]) do
    moved = moved + 1
  end
end
return moved
"""

# The ready list. KEYS: the list the messages go to, the ready list. ARGV: their queue, then
# the messages, oldest first: one, or a batch's for that queue (``ReadyBatch``). Lists the
# queue if they made its list non-empty (LPUSH answers the list's new length).
PUT = """
if redis.call('LPUSH', KEYS[1], unpack(ARGV, 2)) == #ARGV - 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
end
"""
#: Messages one ``PUT`` pushes at most (Lua's ``unpack`` is bounded by its C stack).
PUT_MESSAGES = 1000
# The message of a popped name. KEYS: the ready list, the lists of the queue's levels read,
# highest priority first. ARGV: the queue, 1 if the name came from this node's inbox, the six
# H of liveness.HOLD, the F of takenfacts.FACTS, then the P of placement.PLACE. Returns
# {oldest message, names still listed, its delivery tag if recorded as held, the facts read
# for it}, or nil when the queue is empty or placed on another node (its name is then in
# that node's inbox).
TAKE = (
    HOLD
    + PLACE
    + FACTS
    + """
local H, F, P, lists = {unpack(ARGV, 3, 8)}, ARGV[9], {unpack(ARGV, 10)}, {unpack(KEYS, 2)}
if ARGV[2] ~= '1' and not placed(ARGV[1], lists, P) then return false end
for i = 2, #KEYS do
  local message = redis.call('RPOP', KEYS[i])
  if message then
    relist(ARGV[1], depth(lists), P)
    local listed = redis.call('LLEN', KEYS[1])
    if P[1] ~= '' then listed = listed + redis.call('LLEN', P[1] .. P[2]) end
    local tag, m = hold(message, H)
    return {message, listed, tag, facts(ARGV[1], m, message, F)}
  end
end
return false
"""
)
# Without blocking: the next messages of the ready list's queues (this node's inbox first,
# placement.PLACE), or of the other queues consumed, up to a number, each taken as one take
# after another would take it. KEYS: the ready list, then the other queues' lists. ARGV: 1
# to try the other queues first (they and the ready list then alternate from one message to
# the next), then ``:<tenant>`` to take a listed queue of another tenant before the next of
# that one's (``wm.dataplane.fairshare``); the most messages to take; 1 while tenants compete
# (each message's tenant is then the one the next passes over); the number L of levels, the
# L suffixes of a level's list, then the six H of liveness.HOLD, the F of takenfacts.FACTS
# and the P of placement.PLACE.
# Returns a list of {queue, message, the list it came from, its delivery tag if recorded as
# held, the facts read for a worker queue's message}, oldest first, empty when nothing was
# there. A name whose queue is empty is dropped; one placed on another node goes to its inbox.
TAKE_NEXT = (
    HOLD
    + PLACE
    + FACTS
    + """
local most, crowded, levels = tonumber(ARGV[2]), ARGV[3] == '1', tonumber(ARGV[4])
local H, F = {unpack(ARGV, levels + 5, levels + 10)}, ARGV[levels + 11]
local P = {unpack(ARGV, levels + 12)}
local inbox = P[1] ~= '' and (P[1] .. P[2]) or nil
local function pop()
  local queue = inbox and redis.call('RPOP', inbox)
  if queue then return queue, true end
  return redis.call('RPOP', KEYS[1]), false
end
local function tenant(queue)
  return string.match(queue, '^(.-)::.-::') or 'default'
end
local avoid = string.sub(ARGV[1], 3)
local function avoided(queue)
  return avoid ~= '' and tenant(queue) == avoid
end
local function listed()
  local queue, mine = pop()
  local skipped, first = 0, nil
  while queue do
    if not mine and skipped < 16 and queue ~= first and avoided(queue) then
      redis.call('LPUSH', KEYS[1], queue)  -- the tenant's turn was the last: behind the others
      first, skipped = first or queue, skipped + 1
    else
      local lists = {}
      for l = 5, levels + 4 do lists[#lists + 1] = queue .. ARGV[l] end
      if mine or placed(queue, lists, P) then
        for _, key in ipairs(lists) do
          local message = redis.call('RPOP', key)
          if message then
            relist(queue, depth(lists), P)
            return {queue, message, key, true}
          end
        end
      end
    end
    queue, mine = pop()
  end
  return false
end
local function others()
  for i = 2, #KEYS do
    local message = redis.call('RPOP', KEYS[i])
    if message then return {KEYS[i], message, KEYS[i]} end
  end
  return false
end
local all, others_first = {}, string.sub(ARGV[1], 1, 1) == '1'
while #all < most do
  local taken
  if others_first then
    taken = others() or listed()
  else
    taken = listed() or others()
  end
  if not taken then break end
  local tag, m = hold(taken[2], H)
  if taken[4] then
    taken[5] = facts(taken[1], m, taken[2], F)
    if crowded then avoid = tenant(taken[1]) end
  end
  taken[4] = tag
  all[#all + 1] = taken
  others_first = not others_first
end
return all
"""
)
# KEYS: the ready list, the lists of the queue's levels read. ARGV: the queue. Lists it if it
# holds messages and is not listed.
ARM = """
if redis.call('LPOS', KEYS[1], ARGV[1]) then return 0 end
for i = 2, #KEYS do
  if redis.call('LLEN', KEYS[i]) > 0 then
    redis.call('LPUSH', KEYS[1], ARGV[1])
    return 1
  end
end
return 0
"""
# KEYS: the ready list. ARGV: the placement members' and inboxes' suffixes (placement.MEMBERS,
# placement.INBOX), the number L of levels, the L suffixes of a level's list, then queues.
# Lists each queue that holds messages and is listed neither in the ready list nor in the
# inbox of a member of placement (a node may have died holding its name). A name a node
# holds at this moment is listed twice.
REPAIR = """
local listed = {}
local function read(list)
  for _, queue in ipairs(redis.call('LRANGE', list, 0, -1)) do listed[queue] = true end
end
read(KEYS[1])
for _, node in ipairs(redis.call('ZRANGE', KEYS[1] .. ARGV[1], 0, -1)) do
  read(KEYS[1] .. ARGV[2] .. node)
end
local levels, fixed = tonumber(ARGV[3]), 0
for i = levels + 4, #ARGV do
  local queue = ARGV[i]
  if not listed[queue] then
    for l = 4, levels + 3 do
      if redis.call('LLEN', queue .. ARGV[l]) > 0 then
        redis.call('LPUSH', KEYS[1], queue)
        listed[queue] = true
        fixed = fixed + 1
        break
      end
    end
  end
end
return fixed
"""
#: Queues one repair script looks at.
REPAIR_QUEUES_PER_CALL = 500
