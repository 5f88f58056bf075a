-- Promote: skip the current canary step (weightship promote).
-- Writes a request into status.control.promote (the status subresource), never into spec, so
-- Argo CD shows no drift; the controller acts once and sets acknowledged = requestedAt.
-- requestedAt is the request's identity: a second click within the same second gets a suffix,
-- or the controller would take it for the request it already acknowledged. See docs/api.md.
local now = os.date("!%Y-%m-%dT%XZ")
if obj.status == nil then
  obj.status = {}
end
if obj.status.control == nil then
  obj.status.control = {}
end
local previous = obj.status.control.promote
if previous == nil then
  previous = {}
end
local token = now
local n = 1
while token == previous.requestedAt or token == previous.acknowledged do
  n = n + 1
  token = now .. "-" .. tostring(n)
end
obj.status.control.promote = {
  mode = "Step",
  requestedAt = token,
  requestedBy = "argocd",
  acknowledged = previous.acknowledged,
}
return obj
